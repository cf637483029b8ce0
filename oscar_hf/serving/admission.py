"""One bad request fails alone: what the OSCAR store cannot serve is refused when it is submitted, in the caller's
thread (Transformers' loop treats an exception inside a forward as fatal), as :class:`RequestRefused`; the same checks
run again when the request joins the scheduler. docs/serving.md section 2a."""
from __future__ import annotations

import threading

try:  # transformers[serving]: FastAPI answers an HTTPException with its status code
    from starlette.exceptions import HTTPException as _HTTPError
except ImportError:  # without the serving extra: ValueError alone (Exception before ValueError has no MRO)
    _HTTPError = ValueError

READY_TIMEOUT = 600.0  # seconds add_request waits for a started manager's cache (its first forward waits as long)


class RequestRefused(*dict.fromkeys((_HTTPError, ValueError))):  # (ValueError,) alone without Starlette
    """A request the OSCAR store cannot serve, refused before it reaches the loop (``status_code``: its HTTP status
    through ``transformers serve``; ``detail``: the message)."""

    def __init__(self, message: str, status_code: int = 400):
        if _HTTPError is ValueError:
            ValueError.__init__(self, message)
        else:
            _HTTPError.__init__(self, status_code=status_code, detail=message)
        self.status_code, self.detail = status_code, message

    def __str__(self) -> str:
        return self.detail


class Admission:
    """A manager's live request ids, those claimed by a result handler before submission, and the store once the
    cache exists (``ready``). Ids leave when their last output is delivered or the scheduler cancels them."""

    def __init__(self, vocab_size: int | None):
        self.lock = threading.Lock()
        self.live: set[str] = set()
        self.claimed: set[str] = set()
        self.ready = threading.Event()
        self.store = None
        self.vocab_size = vocab_size  # the token ids a prompt may hold: [0, vocab_size) (None: not checked)
        self.blocks_hold_windows = False
        self.can_fork = False

    def check(self, input_ids, max_new_tokens: int | None, forks: int, can_fork: bool) -> None:
        """Raise :class:`RequestRefused` when the store (None: no pool yet) cannot serve the request.
        ``blocks_hold_windows``: the scheduler's blocks count the window's tokens too (5.17 - 5.19)."""
        if forks > 0 and not can_fork:
            raise RequestRefused(f"the OSCAR paged cache forks requests (num_return_sequences={forks + 1}) only for "
                                 "models whose every layer it quantizes: send one request per sequence")
        n = len(input_ids)
        if n == 0:
            raise RequestRefused("the prompt is empty: a request needs at least one token")
        if self.vocab_size is not None:
            lo, hi = min(input_ids), max(input_ids)
            if lo < 0 or hi >= self.vocab_size:
                raise RequestRefused(f"token id {lo if lo < 0 else hi} is outside the model's vocabulary "
                                     f"[0, {self.vocab_size})")
        store = self.store
        if store is None or not store.has_pool:
            return
        # the tokens the request stores at most: its prompt and every new token but the last (never fed back)
        stored = n + max(int(max_new_tokens or 1), 1) - 1
        pool, p = store.pool, store.pool.page_size
        if self.blocks_hold_windows:  # Transformers allocates ((prompt + 1) // P) + 1 blocks first, then one a step
            need = max(-(-stored // p), (n + 1) // p + 1)
            most = pool.num_pages * p
        else:
            need = store.history_pages(stored, p)
            most = store.config.sink + store.config.recent + pool.num_pages * p
        if need > pool.num_pages:
            raise RequestRefused(
                f"a prompt of {n} tokens with max_new_tokens={max_new_tokens} needs {need} INT2 pages of "
                f"{pool.page_size} tokens; the whole pool has {pool.num_pages} (at most {most} tokens a request): "
                "shorten the prompt or max_new_tokens, or give the server more pages (--cb-num-blocks)")

    def claim(self, request_id: str, has_handler: bool) -> None:
        """A result handler is registered for ``request_id`` (before or right after its ``add_request``); refused
        when the id is claimed, or live with a handler already."""
        with self.lock:
            if request_id in self.claimed or (request_id in self.live and has_handler):
                raise live_id_refusal(request_id)
            if request_id not in self.live:
                self.claimed.add(request_id)

    def submit(self, request_id: str) -> None:
        with self.lock:
            if request_id in self.live:
                raise live_id_refusal(request_id)
            self.claimed.discard(request_id)
            self.live.add(request_id)

    def release(self, *request_ids: str) -> None:
        with self.lock:
            self.live.difference_update(request_ids)
            self.claimed.difference_update(request_ids)


def live_id_refusal(request_id: str) -> RequestRefused:
    return RequestRefused(f"request id {request_id!r} is already live on this server (a retry with the same "
                          "X-Request-ID while the first is running?): wait for it to finish or use another id", 409)


_create_lock = threading.Lock()


def admission_of(manager) -> Admission:
    """The manager's :class:`Admission`, made (and its output router hooked) on first use."""
    with _create_lock:
        adm = manager.__dict__.get("oscar_admission")
        if adm is None:
            adm = Admission(getattr(manager.model.config.get_text_config(decoder=True), "vocab_size", None))
            _hook_router(manager.output_router, adm)
            manager.oscar_admission = adm
    return adm


def _hook_router(router, adm: Admission) -> None:
    """Ids leave before their last output is delivered (a client may resubmit the id as soon as it has it)."""
    deliver, deliver_batch = router.deliver, router.deliver_batch

    def finished(outputs: list) -> list:
        adm.release(*(o.request_id for o in outputs if o.is_finished()))
        return outputs

    router.deliver = lambda output: deliver(finished([output])[0])
    router.deliver_batch = lambda outputs: deliver_batch(finished(outputs))


def install(manager, processor) -> None:
    """Once the batch processor exists: the store for the size checks, and the scheduler's hooks."""
    adm = admission_of(manager)
    scheduler = processor.scheduler
    clear, add_waiting = scheduler.clear_cancelled_requests, scheduler.add_waiting_request

    def clear_cancelled():
        states = clear()
        adm.release(*(s.request_id for s in states))
        return states

    def add_checked(state):
        # new requests (inside a per-request try) and re-queued ones (soft reset, forks)
        rid = state.request_id
        # waiting: in the queue's order (5.17 - 5.19 leave a request that joined a shared prefix in the dict, though
        # active: a soft reset of it re-queues its id)
        if rid in scheduler.active_requests or rid in scheduler.waiting_requests_order:
            raise live_id_refusal(rid)
        if not getattr(state, "_true_initial_tokens", 0) and state.position_offset == 0:  # a new request
            adm.check(state.initial_tokens, state.max_new_tokens, state.num_children, adm.can_fork)
        return add_waiting(state)

    scheduler.clear_cancelled_requests, scheduler.add_waiting_request = clear_cancelled, add_checked
    adm.store = processor.cache.store
    adm.blocks_hold_windows = not hasattr(processor.cache, "cache_allocators")  # 5.17 - 5.19's block manager
    adm.can_fork = processor.cache.oscar_owns_memory
    adm.ready.set()


def add_request(manager, original, input_ids, request_id=None, max_new_tokens=None, *args, **kwargs):
    """``add_request`` of a manager an OSCAR block serves: the id made live, the request checked (once the cache
    exists), then submitted."""
    adm = admission_of(manager)
    if request_id is None:  # Transformers' own naming, taken here so that the id is tracked from the start
        with manager._request_lock:
            request_id = f"req_{manager._request_counter}"
            manager._request_counter += 1
    claimed = request_id in adm.claimed
    adm.submit(request_id)
    out = None
    try:
        waited = 0.0  # until the cache exists, while the loop runs (a manager not started yet checks in the loop)
        while not adm.ready.wait(0.05):
            waited += 0.05
            if not manager.is_running() or waited > READY_TIMEOUT:
                break
        max_new_tokens = manager.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        adm.check(list(input_ids), max_new_tokens, manager.num_return_sequences - 1,
                  adm.can_fork or not adm.ready.is_set())  # (forks: else checked in the loop)
        out = original(manager, input_ids, request_id, max_new_tokens, *args, **kwargs)
    finally:
        if out is None:  # refused, failed or not accepted (a stopping or dead loop): nothing will be delivered for it
            adm.release(request_id)
            if claimed:  # its result handler will never be called
                with manager.output_router._lock:
                    manager.output_router.result_handlers.pop(request_id, None)
    return out


def register_result_handler(manager, original, request_id, callback):
    """``register_result_handler``: refused where it would take a live request's outputs."""
    router = manager.output_router
    with router._lock:
        has_handler = request_id in router.result_handlers
    admission_of(manager).claim(request_id, has_handler)
    return original(manager, request_id, callback)
