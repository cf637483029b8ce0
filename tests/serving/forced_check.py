"""The load test's token check that survives rounding: each served stream teacher-forced through ``OscarCache``.

Comparing a served stream with its prompt's greedy run alone proves nothing after the first step where the two round
differently (BF16 on the GPU: the batched serving step and a single request's ``generate`` take other GEMM tiles), and
on a random model the top-2 logits are often that close. Here every served token is checked instead: the reference
is run on the stream's own tokens (``generate`` with a logits processor that forces them), and at each step the served
token's logit must be within ``tol`` x the step's largest |logit| of the step's best. A server that mixed up requests'
KV, or decoded a row against another row's history, gives tokens far from the best of their own context; the control
(``mismatched``) runs the same check on other prompts' streams and must flag every one.

The server returns text, not token ids: the served tokens are recovered step by step as the best of the step's
``topk`` tokens whose decoding continues the text (a stream none of whose top-``topk`` continues it is wrong).

With the load test's character tokenizer (``serve_load.py --tokenizer chars``, the GPU profile's default) the recovery
is exact: every token but EOS decodes to one character of its own, so exactly one token continues the text at each
step, and the recovered tokens are the served ones. That is what makes the GPU run's check exact: a stream is wrong
only for its tokens' gaps, never for how its text was split.

With a BPE vocabulary (SmolLM2's) a text can split into tokens in more than one way ("Arch" + "itects" or
"Architects"), and its byte-fallback tokens all decode to U+FFFD; where two such tokens are near-tied, the best one
may not be the one served, and the recovered tokens then leave the served ones. A stream that fails the check is
therefore checked once more choosing, among the continuing tokens within ``tol`` of the best, the one that covers the
most text; it is wrong only if neither split follows it. That is a heuristic: on an H100 (BF16, SmolLM2's vocabulary)
7 of 828 streams were still judged wrong only for their split, all of their gaps below 0.05.
"""
from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList


def relative_gap(logits: torch.Tensor, token: int) -> float:
    """How far ``token``'s logit is below the best of ``logits [V]``, over their largest |logit|."""
    logits = logits.float()
    return float((logits.max() - logits[token]) / logits.abs().max().clamp_min(1e-30))


class FollowText(LogitsProcessor):
    """Forces, row by row, the token that continues the row's served text; records its gap to the step's best.

    ``texts[r]`` the served text, ``counts[r]`` its completion tokens (``None``: until the text is matched).
    Per row after the run: ``tokens`` (recovered), ``gaps`` (one per recovered token), ``lost`` (the step where no
    top-``topk`` token continued the text, else ``None``) and ``lost_gap`` (there, the ``topk``-th token's gap: the
    served token's gap was at least that)."""

    def __init__(self, tok, texts: list[str], counts: list[int | None], topk: int = 64,
                 longest_within: float | None = None):
        # topk 64: a random model's logits are nearly flat (top-2 gaps ~4% of the largest |logit|); with 16, 9 of the
        # 1,000 GPU streams (H100, BF16) were lost (no top-16 token continued the text), never judged by their gap
        # longest_within: None takes the best continuing token; a tolerance takes, of the continuing tokens within it
        # of the step's best, the one whose text is longest (the other way to split a near-tied text)
        self.tok, self.texts, self.counts, self.topk, self.longest_within = tok, texts, counts, topk, longest_within
        self.eos = tok.eos_token_id
        n = len(texts)
        self.tokens, self.gaps, self.lost, self.done = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n, \
            [False] * n
        self.lost_gap = [None] * n

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _pick(self, r: int, logits: torch.Tensor) -> int | None:
        """The best of the top-``topk`` tokens that continues row ``r``'s text (EOS once the text is all matched)."""
        have, text = self.tokens[r], self.texts[r]
        before = self._text(have)
        continuing = []  # (token, its decoded text) in the order of their logits
        for c in logits.topk(min(self.topk, logits.numel())).indices.tolist():
            after = self._text(have + [c])
            if c == self.eos or after == before:  # (EOS, or a token that decodes to nothing)
                if before == text:  # (the text all matched)
                    return c
                continue
            if text.startswith(after.rstrip("\ufffd")):
                if self.longest_within is None:
                    return c
                continuing.append((c, after))
        near = [(c, after) for c, after in continuing if relative_gap(logits, c) <= self.longest_within]
        if near:
            return max(near, key=lambda ca: len(ca[1].rstrip("\ufffd")))[0]
        return continuing[0][0] if continuing else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, float("-inf"))
        for r in range(scores.shape[0]):
            want = self.counts[r]
            if not self.done[r] and (len(self.tokens[r]) == want or (want is None and
                                                                     self._text(self.tokens[r]) == self.texts[r])):
                self.done[r] = True
            c = None if self.done[r] else self._pick(r, scores[r])
            if c is None:
                if not self.done[r]:
                    self.lost[r], self.done[r] = len(self.tokens[r]), True
                    kth = int(scores[r].topk(min(self.topk, scores.shape[-1])).indices[-1])
                    self.lost_gap[r] = relative_gap(scores[r], kth)
                forced[r, self.eos] = 0.0  # (finished or lost: EOS ends the row)
                continue
            self.gaps[r].append(relative_gap(scores[r], c))
            self.tokens[r].append(c)
            forced[r, c] = 0.0
        return forced


def forced_check(model, tok, prompts: list[str], texts: list[str], counts: list[int | None], oscar: dict,
                 tol: float, batch: int | None = None) -> list[dict]:
    """For each (prompt, served text, completion tokens): ``verdict`` "followed" (every served token within ``tol`` of
    its step's best under teacher forcing, the whole text recovered) or "wrong" (with ``step`` and ``gap``, or the step
    where the text was ``lost``), ``max_gap``, and the recovered token ids (``token_ids``; with the character tokenizer,
    the served ones). Rows run ``batch`` at a time, left-padded, through one ``OscarCache`` each
    (``method="hadamard"``, uncompiled: the references' settings)."""
    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs

    batch = batch or (64 if model.device.type == "cuda" else 32)
    side, tok.padding_side, pad_token = tok.padding_side, "left", tok.pad_token
    if pad_token is None:  # (a GGUF tokenizer may have none: EOS pads, as generate's pad_token_id below)
        tok.pad_token = tok.eos_token
    pad = tok.pad_token_id

    def check(rows: list[int], longest_within: float | None) -> list[dict]:
        out = []
        for a in range(0, len(rows), batch):
            part = rows[a: a + batch]
            enc = tok([prompts[i] for i in part], return_tensors="pt", padding=True).to(model.device)
            follow = FollowText(tok, [texts[i] for i in part], [counts[i] for i in part],
                                longest_within=longest_within)
            most = max((counts[i] if counts[i] is not None else len(tok(texts[i]).input_ids) + 8) for i in part)
            cache = OscarCache(model, method="hadamard", compile=False, **oscar)
            model.generate(**enc, max_new_tokens=max(1, most + 1), do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=pad, logits_processor=LogitsProcessorList([follow]),
                           **cache_kwargs(model, cache))
            for r, i in enumerate(part):
                gaps, lost = follow.gaps[r], follow.lost[r]
                whole = follow._text(follow.tokens[r]) == texts[i]
                worst = max(range(len(gaps)), key=gaps.__getitem__) if gaps else None
                bad = lost is not None or not whole or (worst is not None and gaps[worst] > tol)
                out.append(dict(verdict="wrong" if bad else "followed", max_gap=max(gaps, default=0.0),
                                step=lost if lost is not None else worst,
                                gap=None if worst is None or lost is not None else gaps[worst],
                                lost=lost, lost_gap=follow.lost_gap[r], recovered=len(follow.tokens[r]),
                                token_ids=follow.tokens[r], split="best"))
        return out

    try:
        out = check(list(range(len(prompts))), None)
        again = [i for i, g in enumerate(out) if g["verdict"] == "wrong"]
        if again:  # (the other split of near-tied texts; a row stays wrong unless it follows)
            for i, g in zip(again, check(again, tol)):
                if g["verdict"] == "followed":
                    out[i] = dict(g, split="longest")
    finally:
        tok.padding_side, tok.pad_token = side, pad_token
    return out
