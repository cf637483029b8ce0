"""A continuous-batching scheduler that runs prompts in steps of their own (``scheduler_type="oscar_prefill_apart"``).

Transformers' schedulers pack a new request's prompt rows into the same forward as every other request's decode row.
Such a mixed step runs eagerly (only decode-only steps replay a CUDA graph), so a request joining a shared prefix
waits through an eager step of all the decode rows besides its own chunk read: 229 - 241 ms at 32 requests on an H100,
against 21 ms for a graphed decode step (docs/serving.md, section 4, "Prefix sharing"). Here a step takes the prompt
rows alone whenever there are any, and the decode rows otherwise, so decode steps stay graphed and a joiner's step
carries no decode rows; the decoding requests pause for one step per prompt chunk. Where the prompts cannot be
scheduled (no room in the cache) the step falls back to Transformers' FIFO choice. ``scripts/serve.py``'s default
(``oscar_serving(scheduler_type=...)``), opt-in elsewhere; it suits traffic of short prompts (prefix joiners): a long
prompt's chunks hold every decoding request for their whole prefill.
"""
from __future__ import annotations

from transformers.generation.continuous_batching import scheduler as cb_scheduler
from transformers.generation.continuous_batching.requests import RequestStatus

NAME = "oscar_prefill_apart"


class PrefillApartScheduler(cb_scheduler.FIFOScheduler):
    """FIFO, but a step holds either prompt rows (every request still prefilling or waiting, as budgets allow) or
    decode rows, never both."""

    def schedule_batch(self, token_budget: int, cache_budget: int):
        decoding = {rid: s for rid, s in self.active_requests.items() if s.status == RequestStatus.DECODING}
        prompts = len(decoding) < len(self.active_requests) or (self.waiting_requests and not self.block_new_requests)
        if not (prompts and decoding):
            return super().schedule_batch(token_budget, cache_budget)
        order = list(self.active_requests)
        for rid in decoding:  # the decoding requests sit this step out (FIFO then sees the prompts alone)
            del self.active_requests[rid]
        try:
            out = super().schedule_batch(token_budget, cache_budget)
        finally:  # back, in their order (a step's rows are packed in the order of active_requests); in place
            rest = dict(self.active_requests)  # (the prompts, and those the step admitted from the waiting ones)
            self.active_requests.clear()
            for rid in order:
                if rid in decoding or rid in rest:
                    self.active_requests[rid] = decoding[rid] if rid in decoding else rest.pop(rid)
            self.active_requests.update(rest)
        if out[0]:
            return out
        return super().schedule_batch(token_budget, cache_budget)  # no prompt fits: the decode rows, as FIFO would


def register() -> None:
    """Make ``ContinuousBatchingConfig(scheduler_type="oscar_prefill_apart")`` choose it (Transformers looks the type
    up in ``SCHEDULER_MAPPING`` when a manager starts, 5.17 - 5.25)."""
    cb_scheduler.SCHEDULER_MAPPING.setdefault(NAME, PrefillApartScheduler)
