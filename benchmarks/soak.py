#!/usr/bin/env python
"""Long-run soak of OscarCache in ``generate`` and of OSCAR serving; exit status 1 when a check fails.

    python benchmarks/soak.py --parts calls --out soak_calls.json             # GPU: 200 generate calls, a few minutes
    python benchmarks/soak.py --parts serving --out serving_soak.json         # GPU: 1,000 requests, two models
    python benchmarks/soak.py --tiny --out /tmp/soak.json                       # CPU: tiny shapes, seconds

Model: Qwen3-shaped, random weights (head_dim 128, 8 KV heads, 32 query heads, 4 layers, small hidden size and
vocabulary); ``eos_token_id`` is set, so ``min_new_tokens`` keeps ``generate`` going.

(a) ``--parts long``: ONE ``generate`` call of ``--long-new-tokens`` (32768) tokens after a ``--long-prompt``
    left-padded batch. A logits processor counts non-finite scores on the device (the EOS column's ``-inf`` from
    ``min_new_tokens`` excepted) and every ``--every`` tokens records memory and ``cache.memory_report()``. Checks:
    every token generated, no non-finite score, a finite final cache; the memory that is not the cache's own
    (``memory_allocated - memory_report()["allocated"]``) stays within ``--mem-tol-mib`` of its first post-warm-up
    value; the cache grows by the same bytes every token once the history is non-empty.
(b) ``--parts calls``: ``--calls`` (200) ``generate`` calls on the same prompts, cycling through greedy / seeded
    sampling with ``reset()`` of one long-lived cache / a fresh ``OscarCache``. Checks: every greedy (sampled) output
    equals the first; memory between calls and each kind of call's peak (:func:`check_peaks_flat`) do not grow after
    ``--warmup`` calls (``--calls-mem-tol-mib``), nor does the number of live tensors (``gc``).
(c) ``--parts serving``: ``--requests`` (1,000) requests with cancellations and model switches through
    ``oscar_serving`` (what ``scripts/serve.py`` runs: a fresh store per manager, per model): two random-weight models
    of different shapes (Llama, Qwen3) taking ``--rounds`` (10) rounds in turn, each round a manager that gets requests
    of random prompt and answer lengths, cancels every 5th right after it is sent and a few more while decoding, then
    stops. Checks: every request not cancelled finishes with its ``max_new_tokens`` tokens, none fails; after each
    round the store holds nothing and is garbage once the manager is dropped; live tensors and (CUDA)
    ``memory_allocated`` come back to the first round's of the same model, taken after
    ``torch._C._cuda_clearCublasWorkspaces()`` (PyTorch keeps a cuBLAS workspace per stream, and every manager has
    streams of its own: ``memory_mib_raw`` is without it).

``--tiny`` (CPU): tiny shapes, sink 8 / recent 16, 160 new tokens, 8 calls, no CUDA memory checks.
``--inject-nan-at N`` corrupts the cache at step N (a test that the checks fire).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
import warnings
import weakref
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from oscar_hf import OscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.serving import continuous_batching_config, oscar_serving

MiB = 2**20
EOS = 2
SHAPES = {
    "soak": dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=256),
}
TINY_DEFAULTS = dict(long_prompt=48, long_new_tokens=160, long_batch=2, every=32, calls=8, calls_prompt=40,
                     calls_new_tokens=6, warmup=2, sink=8, recent=16, count_every=2)
GPU_DEFAULTS = dict(long_prompt=1024, long_new_tokens=32768, long_batch=2, every=1024, calls=200, calls_prompt=512,
                    calls_new_tokens=32, warmup=8, sink=64, recent=256, count_every=25)

SERVING_SHAPES = {  # (A, B): two model types of different shapes (a switch changes every tensor's size)
    "soak": (dict(model_type="llama", hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000),
             dict(model_type="qwen3", hidden_size=768, intermediate_size=1536, num_hidden_layers=3,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=128, vocab_size=32000)),
    "tiny": (dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256),
             dict(model_type="qwen3", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256)),
}
SERVING = dict(requests=1000, rounds=10, min_prompt=16, max_prompt=2048, max_new=32, cancel_every=5,
                sink=64, recent=128, group_size=64, page_size=64, num_blocks=2048, max_batch_tokens=1024,
                max_requests=32)
SERVING_TINY = dict(requests=120, rounds=6, min_prompt=3, max_prompt=60, max_new=6, cancel_every=5, sink=4, recent=8,
            group_size=32, page_size=8, num_blocks=128, max_batch_tokens=32, max_requests=8)


def build_model(spec: dict, dtype, device, seed: int, **config):
    """Random weights (drawn from ``seed``) of ``spec``'s config fields (``model_type`` default qwen3) + ``config``."""
    spec = dict(spec)
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(spec.pop("model_type", "qwen3"), **spec, **config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def prompts(vocab: int, batch: int, length: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab - 1, (batch, length), generator=g)
    am = torch.ones_like(ids)
    for b in range(1, batch):  # row b left-padded by b * length // 4 (capped)
        am[b, : min(length - 4, b * length // 4)] = 0
    return ids.masked_fill(am == 0, 0).to(device), am.to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_mem(device) -> dict:
    if device.type != "cuda":
        return {}
    return dict(allocated=torch.cuda.memory_allocated(device), peak=torch.cuda.max_memory_allocated(device))


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on lazily deprecated module attributes may warn
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def cache_finite(cache) -> bool:
    ok = True
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or getattr(layer, "hist_k", None) is None:
            continue
        for t in (layer.win, layer.meta):  # (zeros past the written entries)
            ok &= bool(torch.isfinite(t).all())
    return ok


class Monitor(LogitsProcessor):
    """Per step: non-finite scores (device-side count, no sync). Every ``every`` steps: memory + cache report."""

    def __init__(self, cache, every: int, vocab: int, device, inject_nan_at: int | None = None):
        self.cache, self.every, self.device, self.inject_nan_at = cache, every, device, inject_nan_at
        keep = torch.ones(vocab, dtype=torch.bool)
        keep[EOS] = False  # min_new_tokens sets the EOS score to -inf until the minimum is reached
        self.keep = keep.nonzero().squeeze(1).to(device)
        self.bad = torch.zeros((), dtype=torch.long, device=device)
        self.bad_eos = torch.zeros((), dtype=torch.long, device=device)  # NaN / +inf on the EOS column
        self.step, self.samples, self.t0 = 0, [], time.perf_counter()

    def record(self):
        sync(self.device)
        rep, mem = self.cache.memory_report(), cuda_mem(self.device)
        s = dict(step=self.step, seq_len=self.cache.get_seq_length(), t=time.perf_counter() - self.t0,
                 cache_used=int(rep["total"]), cache_allocated=int(rep["allocated"]),
                 history_codes=int(rep["history_codes"]), nonfinite_so_far=int(self.bad))
        s["sinks_full"] = all(bool((layer.host_len - layer.pad >= layer.config.sink).all())
                              for layer in self.cache.layers
                              if getattr(layer, "hist_k", None) is not None and layer.is_initialized)
        if mem:
            s.update(mem_allocated=mem["allocated"], non_cache=mem["allocated"] - s["cache_allocated"])
        self.samples.append(s)
        print(json.dumps(s), flush=True)  # (a run cut short by a time limit still shows how far it got)

    def __call__(self, input_ids, scores):
        if self.step == self.inject_nan_at:
            for layer in self.cache.layers:  # corrupt one stored scale: its history token's logits become NaN
                n = layer.host_len - layer.config.recent - layer.config.sink if layer.is_initialized else 0
                if getattr(layer, "hist_k", None) is not None and n > 1:  # (entry n - 1 is written again next step)
                    layer.hist_k.scale[:, :, n - 2] = float("nan")
        self.bad += (~torch.isfinite(scores.index_select(1, self.keep))).sum()
        e = scores[:, EOS]
        self.bad_eos += (torch.isnan(e) | torch.isposinf(e)).sum()
        if self.step % self.every == 0:
            self.record()
        self.step += 1
        return scores


def check(checks: dict, name: str, ok: bool, **detail):
    checks[name] = dict(ok=bool(ok), **detail)
    if not ok:
        print(f"CHECK FAILED: {name}: {detail}", flush=True)


# ---------------------------------------------------------------------------------------------- (a)
def long_run(model, a, device, checks) -> dict:
    vocab = model.config.vocab_size
    ids, am = prompts(vocab, a.long_batch, a.long_prompt, a.seed, device)
    cache = OscarCache(model, method="hadamard", sink=a.sink, recent=a.recent)
    mon = Monitor(cache, a.every, vocab, device, a.inject_nan_at)
    n = a.long_new_tokens
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, **cache_kwargs(model, cache), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, logits_processor=LogitsProcessorList([mon]))
    mon.record()  # final state (after the last token's forward)
    new, s, wall = out.shape[1] - ids.shape[1], mon.samples, mon.samples[-1]["t"]
    res = dict(prompt=a.long_prompt, batch=a.long_batch, new_tokens=new, wall_s=wall, ms_per_token=1000 * wall / max(new, 1),
               samples=s, memory_report_final={k: float(v) for k, v in cache.memory_report().items()},
               nonfinite_scores=int(mon.bad), nonfinite_eos=int(mon.bad_eos))
    check(checks, "long.tokens", new == n, generated=new, requested=n)
    check(checks, "long.finite_scores", int(mon.bad) == 0 and int(mon.bad_eos) == 0, nonfinite=int(mon.bad),
          eos=int(mon.bad_eos))
    check(checks, "long.finite_cache", cache_finite(cache))
    # the last generated token is never fed back: the cache holds prompt + n - 1 positions
    check(checks, "long.seq_len", cache.get_seq_length() == a.long_prompt + n - 1, seq_len=cache.get_seq_length())
    # Once every row's sink is full (left-padded rows fill theirs later), each new token demotes one token per row to
    # INT2: the same bytes every step.
    hist = [x for x in s if x["history_codes"] > 0 and x["sinks_full"]]
    rates = [(y["cache_used"] - x["cache_used"]) / (y["seq_len"] - x["seq_len"])
             for x, y in zip(hist[1:], hist[2:]) if y["seq_len"] > x["seq_len"]]
    if rates:
        res["cache_bytes_per_token"] = dict(min=min(rates), max=max(rates))
        check(checks, "long.cache_linear", max(rates) - min(rates) < 1e-6 * max(rates), **res["cache_bytes_per_token"])
    if device.type == "cuda" and len(s) >= 3:  # s[1]: the first record after the warm-up (prefill, Triton compiles)
        grow = max(x["non_cache"] for x in s[1:]) - s[1]["non_cache"]
        res["non_cache_growth_mib"] = grow / MiB
        check(checks, "long.memory_flat", grow <= a.mem_tol_mib * MiB, growth_mib=grow / MiB, tol_mib=a.mem_tol_mib)
    del out, cache, mon
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------- (b)
def late_growth(values: list[float]) -> float:
    """How much the second half of a series rises above the first half's highest value: a leak keeps growing and
    shows; a one-time step early on (a cache or graph built once) or values that alternate (an allocator block taken
    on some calls) do not."""
    if len(values) < 2:
        return 0.0
    half = len(values) // 2
    return max(values[half:]) - max(values[:half])


def check_peaks_flat(checks: dict, records: list[dict], tol_mib: float) -> dict[str, dict]:
    """``calls.peak_flat``: per kind of call (``reset_greedy``, ``fresh_sample``, ...: calls of one kind do the same
    work), the highest per-call peak is within ``tol_mib`` of the kind's first. Kinds are not compared with each
    other: a fresh cache allocates its buffers while the reset one still holds its own, so fresh-cache calls peak
    about one cache above reset-cache calls however long the run. Returns each kind's first / highest peak and
    growth (MiB)."""
    peaks: dict[str, list[int]] = {}
    for r in records:
        peaks.setdefault(f"{'reset' if r['reuse'] else 'fresh'}_{r['kind']}", []).append(r["peak"])
    by_kind = {k: dict(first_mib=p[0] / MiB, max_mib=max(p) / MiB, growth_mib=(max(p) - p[0]) / MiB)
               for k, p in sorted(peaks.items())}
    growth = max(p["growth_mib"] for p in by_kind.values())
    check(checks, "calls.peak_flat", growth <= tol_mib, growth_mib=growth, tol_mib=tol_mib, peaks_by_kind=by_kind)
    return by_kind


def many_calls(model, a, device, checks) -> dict:
    ids, am = prompts(model.config.vocab_size, 2, a.calls_prompt, a.seed + 1, device)
    n = a.calls_new_tokens
    keep = OscarCache(model, method="hadamard", sink=a.sink, recent=a.recent)
    ref, calls, counts, mismatches = {}, [], [], {"greedy": [], "sample": []}
    for i in range(a.calls):
        reuse, kind = i % 2 == 0, "sample" if (i // 2) % 2 else "greedy"
        if reuse:
            keep.reset()
        cache = keep if reuse else OscarCache(model, method="hadamard", sink=a.sink, recent=a.recent)
        if cache.get_seq_length() != 0:
            check(checks, f"calls.reset_{i}", False, seq_len=cache.get_seq_length())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        kw = dict(do_sample=True, top_k=50, temperature=1.0) if kind == "sample" else dict(do_sample=False)
        torch.manual_seed(a.seed + 7)
        try:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=am, **cache_kwargs(model, cache), max_new_tokens=n,
                                     min_new_tokens=n, **kw)
        except Exception as e:  # noqa: BLE001 - a crash is a failed check, reported with the rest
            check(checks, "calls.no_exception", False, call=i, kind=kind, reuse=reuse, error=repr(e)[:500])
            break
        toks = out[:, ids.shape[1]:].cpu()
        if not torch.equal(ref.setdefault(kind, toks), toks):
            mismatches[kind].append(i)
        rec = dict(i=i, kind=kind, reuse=reuse, peak=torch.cuda.max_memory_allocated(device) if cuda_mem(device) else 0)
        del out, toks, cache
        keep.reset()  # the long-lived cache releases its buffers between calls
        gc.collect()
        rec["allocated_between_calls"] = cuda_mem(device).get("allocated", 0)
        if i >= a.warmup and ((i - a.warmup) % a.count_every == 0 or i == a.calls - 1):
            counts.append(dict(i=i, live_tensors=live_tensors()))
        calls.append(rec)
    res = dict(calls=a.calls, prompt=a.calls_prompt, new_tokens=n, records=calls, live_tensor_counts=counts,
               reference_tokens={k: v.tolist() for k, v in ref.items()}, mismatches=mismatches)
    checks.setdefault("calls.no_exception", dict(ok=True))
    check(checks, "calls.all_calls_ran", len(calls) == a.calls, ran=len(calls), requested=a.calls)
    check(checks, "calls.greedy_identical", not mismatches["greedy"], mismatching_calls=mismatches["greedy"][:20])
    check(checks, "calls.sampled_identical", not mismatches["sample"], mismatching_calls=mismatches["sample"][:20])
    check(checks, "calls.sampling_is_random", len(ref) < 2 or not torch.equal(ref["sample"], ref["greedy"]))
    if len(counts) >= 2:  # (H200: 2363 at call 8, 2957 from call 33 to 199: built once, not a leak)
        growth = late_growth([c["live_tensors"] for c in counts])
        check(checks, "calls.live_tensors_flat", growth <= 2, late_growth=growth, counts=[c["live_tensors"] for c in counts])
    post = [r for r in calls if r["i"] >= a.warmup]
    if device.type == "cuda" and post:
        # (H200: 281.0 / 313.0 MiB alternating over 200 calls, a 32 MiB block held after some calls)
        grow = late_growth([r["allocated_between_calls"] for r in post])
        res["allocated_growth_mib"] = grow / MiB
        check(checks, "calls.memory_flat", grow <= a.calls_mem_tol_mib * MiB, growth_mib=grow / MiB,
              tol_mib=a.calls_mem_tol_mib)
        res["peaks_by_kind"] = check_peaks_flat(checks, post, a.calls_mem_tol_mib)
    return res


# ---------------------------------------------------------------------------------------------- (c)
def serve_round(model, stores, c, rng: random.Random, n: int) -> dict:
    """One manager's life: ``n`` requests, cancellations, then stop; what its store held after."""
    cb = continuous_batching_config(num_blocks=c.num_blocks, max_batch_tokens=c.max_batch_tokens,
                                    page_size=c.page_size)
    gen = GenerationConfig(max_new_tokens=c.max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    vocab = model.config.vocab_size
    wanted, cancelled = {}, set()
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(c.min_prompt, c.max_prompt))]
        new = rng.randint(1, c.max_new)
        rid = manager.add_request(prompt, max_new_tokens=new)
        wanted[rid] = new
        if i % c.cancel_every == 0:  # cancelled right after it was sent (maybe before its prefill)
            manager.cancel_request(rid)
            cancelled.add(rid)
    late = [rid for rid in wanted if rid not in cancelled and wanted[rid] > 1][: max(1, n // (2 * c.cancel_every))]
    got, errors, deadline = {}, [], time.monotonic() + 600.0
    while len(got) + len(errors) < len(wanted) - len(cancelled) and time.monotonic() < deadline:
        r = manager.get_result(timeout=1.0)
        if r is None:
            continue
        if r.error:
            errors.append(str(r.error))
        elif r.request_id not in cancelled:
            got[r.request_id] = r
        for rid in list(late):  # cancelled while decoding: once some request has finished
            late.remove(rid)
            if rid not in got:
                manager.cancel_request(rid)
                cancelled.add(rid)
    manager.stop(block=True)
    wrong = {rid: (len(r.generated_tokens), wanted[rid]) for rid, r in got.items()
             if len(r.generated_tokens) != wanted[rid]}
    missing = sorted(set(wanted) - cancelled - set(got))
    (store,) = list(stores)
    held = dict(requests=len(store.requests), pages=store.pool.num_used if store.pool is not None else 0,
                window_bytes=store.windows.nbytes, prompt_reserved=store.prompt_reserved)
    ref = weakref.ref(store)
    del store, manager
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    gc.collect()
    return dict(requests=n, finished=len(got), cancelled=len(cancelled), errors=errors[:3], wrong_lengths=wrong,
                missing=missing[:5], held_after_stop=held, store_released=ref() is None)


def serving_run(a, device, checks) -> dict:
    c = argparse.Namespace(**{**(SERVING_TINY if a.tiny else SERVING), **{k: v for k, v in (("requests", a.requests),
                                                                                            ("rounds", a.rounds)) if v}})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = [build_model(spec, dtype, device, a.seed + i, max_position_embeddings=8192)
              for i, spec in enumerate(SERVING_SHAPES["tiny" if a.tiny else "soak"])]
    rng, records, first = random.Random(a.seed), [], {}
    kw = dict(max_requests=c.max_requests, method="hadamard", sink=c.sink, recent=c.recent, group_size=c.group_size)
    with oscar_serving(**kw) as stores:
        for r in range(c.rounds):
            which = r % 2
            rec = serve_round(models[which], stores, c, rng, c.requests // c.rounds)
            rec.update(round=r, model="AB"[which], live_tensors=live_tensors(), stores_alive=len(stores))
            if device.type == "cuda":
                raw = torch.cuda.memory_allocated()
                torch._C._cuda_clearCublasWorkspaces()  # (PyTorch's per-stream cuBLAS workspaces: the docstring's (c))
                rec.update(memory_mib_raw=round(raw / MiB, 2), memory_mib=round(torch.cuda.memory_allocated() / MiB, 2))
            first.setdefault(which, rec)
            records.append(rec)
            print(json.dumps({k: rec[k] for k in ("round", "model", "finished", "cancelled", "live_tensors")}), flush=True)
    check(checks, "serving.no_errors", not any(r["errors"] for r in records), errors=[r["errors"] for r in records])
    check(checks, "serving.lengths", not any(r["wrong_lengths"] or r["missing"] for r in records),
          wrong=[(r["round"], r["wrong_lengths"], r["missing"]) for r in records if r["wrong_lengths"] or r["missing"]])
    check(checks, "serving.cancelled_some", all(r["cancelled"] > 0 for r in records))
    check(checks, "serving.nothing_held_after_stop", all(not any(r["held_after_stop"].values()) for r in records),
          held=[(r["round"], r["held_after_stop"]) for r in records if any(r["held_after_stop"].values())])
    check(checks, "serving.stores_released", all(r["store_released"] and r["stores_alive"] == 0 for r in records))
    grow = [r["live_tensors"] - first[r["round"] % 2]["live_tensors"] for r in records]
    check(checks, "serving.live_tensors_flat", max(grow) <= 64, growth=grow)
    if device.type == "cuda":
        mem = [r["memory_mib"] - first[r["round"] % 2]["memory_mib"] for r in records]
        check(checks, "serving.memory_flat", max(mem) <= 16.0, growth_mib=mem,
              raw_growth_mib=[r["memory_mib_raw"] - first[r["round"] % 2]["memory_mib_raw"] for r in records])
    return dict(rounds=records, settings=vars(c))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU test)")
    p.add_argument("--parts", nargs="+", default=["long", "calls"], choices=["long", "calls", "serving"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    for k, v in GPU_DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v} ({TINY_DEFAULTS[k]} with --tiny)")
    p.add_argument("--mem-tol-mib", type=float, default=64.0, help="(a) allowed growth of non-cache memory")
    p.add_argument("--calls-mem-tol-mib", type=float, default=4.0, help="(b) allowed growth of memory between calls / per-call peak")
    p.add_argument("--inject-nan-at", type=int, default=None, help="(a) corrupt a stored scale at this step (checks must fail)")
    p.add_argument("--requests", type=int, default=None, help="(c) default 1000 (120 with --tiny)")
    p.add_argument("--rounds", type=int, default=None, help="(c) default 10 (6 with --tiny)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    for k, v in (TINY_DEFAULTS if a.tiny else GPU_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.calls_prompt <= a.sink + a.recent or a.long_prompt + a.long_new_tokens <= a.sink + a.recent:
        p.error("prompts must exceed sink + recent so that the INT2 history is exercised")
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = "tiny" if a.tiny else "soak"
    max_pos = max(a.long_prompt + a.long_new_tokens, a.calls_prompt + a.calls_new_tokens) + 16
    model = build_model(SHAPES[shape], dtype, device, a.seed, max_position_embeddings=max_pos, eos_token_id=EOS,
                        pad_token_id=0) if {"long", "calls"} & set(a.parts) else None
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    res = dict(shape=dict(SHAPES[shape]), dtype=str(dtype), device=dev_name,
               torch=torch.__version__, transformers=__import__("transformers").__version__, args=vars(a))
    checks: dict = {}
    if "long" in a.parts:
        try:
            res["long"] = long_run(model, a, device, checks)
        except Exception as e:  # noqa: BLE001 - reported as a failed check, the JSON is still written
            check(checks, "long.no_exception", False, error=repr(e)[:500])
            res["long"] = {}
        print(json.dumps({k: v for k, v in res["long"].items() if k != "samples"}), flush=True)
    if "calls" in a.parts:
        res["calls"] = many_calls(model, a, device, checks)
        print(json.dumps({k: v for k, v in res["calls"].items() if k not in ("records", "reference_tokens")}), flush=True)
    if "serving" in a.parts:
        del model
        gc.collect()
        res["serving"] = serving_run(a, device, checks)
    res["checks"] = checks
    res["ok"] = all(c["ok"] for c in checks.values())
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(dict(ok=res["ok"], failed=[k for k, c in checks.items() if not c["ok"]])), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
