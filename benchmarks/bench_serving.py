#!/usr/bin/env python
"""Load test of Transformers' continuous batching (``ContinuousBatchingManager``, what ``generate_batch`` and
``transformers serve --continuous-batching`` run): BF16 paged (Transformers' own ``PagedAttentionCache``, sdpa)
against OSCAR paged (:func:`oscar_hf.serving.paged_oscar`) in the same KV memory budget, one after the other in one
process, on a random-initialised model of a real shape (default Qwen3-8B). Parts (``--parts``):

* ``capacity``: as many requests of ``--context`` tokens as each cache admits in ``--kv-budget-gib`` (or
  ``--concurrency``), at once. Reported: peak concurrency and the aggregate decode tokens/s while that many decode.
* ``load``: ``--requests`` requests of mixed prompt lengths (``--lengths``) arriving over time (Poisson, ``--rate``
  requests/s). Reported: completed tokens/s (over the makespan), time to first token p50 / p90, peak concurrency.
* ``prefix``: ``--requests`` prompts of one ``--context``-token prefix and 64 tokens of their own: the first alone,
  the others from its first token on (``--retained``: its last; they join its retained pages), one every ``1 / --rate``
  s. Kinds ``oscar-shared`` (sharing), ``oscar``, ``bf16`` (Transformers'). Reported: the first's and the others' TTFT.

``*-graphs``: Transformers' CUDA graphs (OSCAR graphs its decode-only steps, BF16 every step).
``decode_step_ms_p50``: the median gap between a request's consecutive tokens at the peak concurrency. Memory: BF16
gets ``budget / (bytes of a 256-token block of every layer)`` blocks, OSCAR ``max_requests`` window slots and the INT2
pages the rest pays for; ``torch.cuda.max_memory_allocated`` (minus the weights) is reported.

    python benchmarks/bench_serving.py --parts capacity load --out serving.json
    python benchmarks/bench_serving.py --shape tiny --device cpu --context 256 --kv-budget-gib 0.01 ...   (smoke)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: F401  (types)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import SHAPES, build_model, run_env, write_json  # noqa: E402

from oscar_hf.serving import OscarPagedStore, continuous_batching_config, paged_oscar  # noqa: E402
from oscar_hf.serving.warmup import warm_kernels  # noqa: E402

TIMEOUT_S = 540.0  # a run that has not finished by then is stuck (inside the device machine's 10 minutes)
PAGE = 256  # Transformers' default page size (and flash's block-table granularity)
COMPILES: list = []  # (perf_counter, kernel, seconds) of every Triton compile once traced (trace_compiles)
CAPTURES: list = []  # perf_counter at the end of every CUDA graph capture once traced (trace_captures)
PROFILED: list = []  # [True] once a step of this process was profiled
PROFILES: list = []  # stop_profile's summaries of the steps trace_steps(profile_joiner=) profiled


def bf16_block_bytes(cfg) -> int:
    """Bytes of one BF16 block: ``PAGE`` tokens of keys and values of every layer."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * PAGE * cfg.head_dim * 2


def cache_configs(model, kind: str, budget: int, max_batch_tokens: int, max_requests: int, oscar_kw: dict,
                  q_padding: int = 8, scheduler: str = "fifo"):
    """``(ContinuousBatchingConfig, store or None)`` spending ``budget`` bytes of KV (``*-graphs`` kinds: with
    Transformers' CUDA graphs, batches padded to ``q_padding`` rows; ``scheduler``: its ``scheduler_type``)."""
    # oscar-shared-graphs: Transformers' decode graphs only (the store runs steps with prompt rows eager anyway)
    on = (False, True) if kind == "oscar-shared-graphs" else True
    graphs = dict(use_cuda_graph=on, q_padding_interval_size=q_padding) if kind.endswith("-graphs") else \
        dict(use_cuda_graph=False)
    if kind.startswith("bf16"):
        blocks = budget // bf16_block_bytes(model.config)
        return continuous_batching_config(num_blocks=blocks, page_size=PAGE, max_batch_tokens=max_batch_tokens,
                                          scheduler_type=scheduler, **graphs), None
    store = OscarPagedStore(model, defer_pool=True, max_requests=max_requests, device=model.device, dtype=model.dtype,
                            prefix_sharing=kind.startswith("oscar-shared"), **oscar_kw)
    pages = store.pages_in(budget, PAGE, max_batch_tokens)  # after the windows and the prompt transient it reserves
    return continuous_batching_config(num_blocks=pages, page_size=PAGE, max_batch_tokens=max_batch_tokens,
                                      scheduler_type=scheduler, **graphs), store


def admitted_at(model, kind: str, store, cb: ContinuousBatchingConfig, context: int, new_tokens: int) -> int:
    """Requests of ``context + new_tokens`` tokens the budget holds at once (what the scheduler will admit)."""
    if kind.startswith("bf16"):
        return cb.num_blocks // -(-(context + new_tokens) // PAGE)
    pages = max(1, store.history_pages(context + new_tokens, PAGE))
    return min(store.windows.num_slots, cb.num_blocks // pages)


def concurrency(outs) -> tuple[int, float, float]:
    """``(peak, t_a, t_b)``: most requests decoding at once (between their first and last token) and the interval
    where that many did."""
    events = sorted([(o.timestamps[0], 1) for o in outs] + [(o.timestamps[-1], -1) for o in outs])
    live, peak, t_a, t_b = 0, 0, 0.0, 0.0
    for i, (t, d) in enumerate(events):
        live += d
        if live > peak:
            peak, t_a = live, t
            t_b = events[i + 1][0] if i + 1 < len(events) else t
    return peak, t_a, t_b


def trace_steps(store, profile_joiner: int = 0) -> list:
    """``[(t, prompt rows, decode rows)]``, one a forward, appended as the store plans it (``t``: perf_counter; a step
    lasts until the next one starts, since greedy serving reads every step's tokens before the next).
    ``profile_joiner`` = k > 0: the k-th step whose prompt rows are a joiner's (fewer than 1,024) runs under
    ``torch.profiler`` (``PROFILES``; one a process: a second profiler started in the manager's thread failed to
    initialize on an H100, and the profiled step's run is slower after it: its timings are not results)."""
    steps, plan, last = [], store.plan_decode, [None]
    joiners, profiling = [0], []

    def traced(batch, rows=None):
        if tuple(batch) != last[0]:  # (a step without decode rows plans again in each layer: one entry a forward)
            last[0] = tuple(batch)
            decode = sum(1 for _, past, q in batch if q == 1 and past > 0)
            prompt = sum(q for _, past, q in batch) - decode
            if profiling:  # (the profiled step ends where the next one starts: its tokens were read on the host)
                stop_profile(profiling.pop(), steps[-1])
            joiners[0] += 0 < prompt < 1024
            if profile_joiner and joiners[0] == profile_joiner and 0 < prompt < 1024 and not PROFILED:
                PROFILED.append(True)
                profiling.append(start_profile())
            steps.append((time.perf_counter(), prompt, decode))
        return plan(batch, rows)

    store.plan_decode = traced
    return steps


def trace_captures() -> list:
    """``[t]``: when each CUDA graph capture of this process ends from now on (a capture inside a served step runs its
    forward twice, eagerly, and stalls it)."""
    graph = getattr(torch.cuda, "CUDAGraph", None)
    end = getattr(graph, "capture_end", None)
    if end is not None and not getattr(end, "traced", False):
        def traced(self, *a, **kw):
            out = end(self, *a, **kw)
            CAPTURES.append(time.perf_counter())
            return out

        traced.traced = True
        graph.capture_end = traced
    return CAPTURES


def start_profile():
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    prof.__enter__()
    return prof


def stop_profile(prof, step) -> None:
    """One step's profile into ``PROFILES``: its host time, its GPU kernels' time and the ops that took most of
    either (self time, ms)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    host_ms = 1000 * (time.perf_counter() - step[0])
    prof.__exit__(None, None, None)
    ev = prof.key_averages()
    gpu = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    top = lambda key: [(e.key[:80], e.count, round(key(e) / 1000, 3))  # noqa: E731
                       for e in sorted(ev, key=key, reverse=True)[:20] if key(e) > 0]
    PROFILES.append(dict(prompt_rows=step[1], decode_rows=step[2], host_ms=round(host_ms, 2),
                         gpu_ms=round(sum(gpu(e) for e in ev) / 1000, 3),
                         launches=sum(e.count for e in ev if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel",
                                                                              "cudaGraphLaunch"))),
                         top_cpu=top(lambda e: e.self_cpu_time_total), top_gpu=top(gpu)))


def triton_cache_files() -> int | None:
    """Files in Triton's on-disk kernel cache (``TRITON_CACHE_DIR``, else ``~/.triton/cache``): 0 on a fresh machine,
    where every kernel variant a run meets is compiled inside it (None: no cache folder)."""
    import os

    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for f in root.rglob("*") if f.is_file()) if root.is_dir() else None


def trace_compiles() -> list:
    """``[(t, kernel, seconds, variant)]``: every Triton JIT compile (or disk-cache load) of this process from now on
    (a compile inside a served step stalls it)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return COMPILES
    compile_ = getattr(JITFunction, "_do_compile", None)
    if compile_ is None or getattr(compile_, "traced", False):
        return COMPILES

    def traced(self, *args, **kwargs):
        t = time.perf_counter()
        out = compile_(self, *args, **kwargs)
        # (the variant: its constexprs and specializations, to tell which argument made a new one)
        variant = str(kwargs.get("constexprs", args[3] if len(args) > 3 else ""))[:400]
        COMPILES.append((t, getattr(self.fn, "__name__", "?"), round(time.perf_counter() - t, 3), variant))
        return out

    traced.traced = True
    JITFunction._do_compile = traced
    return COMPILES


def step_summary(steps, outs, compiles=(), captures=()) -> dict:
    """The traced steps (:func:`trace_steps`) by kind: how long the steps with prompt rows and the decode-only ones
    took, and for each later request the steps between its arrival and its first token."""
    spans = [(t, b[0] - t, pr, dr) for (t, pr, dr), b in zip(steps, steps[1:])]  # [(start, seconds, prompt, decode)]
    med = lambda xs: round(1000 * sorted(xs)[len(xs) // 2], 2) if xs else None  # noqa: E731
    waits = []
    for o in sorted(outs, key=lambda o: o.created_time)[1:]:
        inside = [s for s in spans if s[0] + s[1] > o.created_time and s[0] < o.timestamps[0]]
        waits.append(dict(request=o.request_id, ttft_s=round(o.timestamps[0] - o.created_time, 3),
                          steps=[(round(1000 * d, 1), pr, dr, [(k, c) for t, k, c, _ in compiles if s <= t < s + d],
                                  sum(s <= t < s + d for t in captures)) for s, d, pr, dr in inside]))
    return dict(mixed_step_ms_p50=med([d for _, d, pr, _ in spans if pr]),
                decode_step_ms_p50=med([d for _, d, pr, dr in spans if not pr and dr]),
                mixed_steps=sum(1 for s in spans if s[2]), steps=len(spans),
                compiles=[(round(t - steps[0][0], 3), k, c) for t, k, c, _ in compiles if steps and t >= steps[0][0]],
                compile_variants=[(k, v) for t, k, _, v in compiles if steps and t >= steps[0][0]],
                graph_captures=sum(1 for t in captures if steps and t >= steps[0][0]),
                later_requests=waits)


def serve(model, kind: str, prompts, arrivals, new_tokens: int, cb: ContinuousBatchingConfig, store,
          retained=False, trace=False, profile_joiner: int = 0) -> dict:
    """Submit ``prompts`` at ``arrivals`` (seconds from the start) to a fresh manager; collect every result.
    ``arrivals[0] < 0``: the first alone, the others' arrivals from its first token (``retained``: its last).
    ``trace``: each step's prompt and decode rows and length (:func:`step_summary`)."""
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    ctx = paged_oscar(model, store) if kind.startswith("oscar") else contextlib.nullcontext()
    lead = arrivals[0] < 0  # the first request alone: the others' arrivals count from its first token
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated() if cuda else 0
    outs, errors = [], []
    steps = trace_steps(store, profile_joiner) if trace and store is not None else None
    compiles = trace_compiles() if steps is not None else []
    captures = trace_captures() if steps is not None else []
    with ctx:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        t0 = time.perf_counter()
        for i, (prompt, at) in enumerate(zip(prompts, arrivals)):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            manager.add_request(prompt, f"r{i}", max_new_tokens=new_tokens, record_timestamps=True, streaming=lead)
            while lead and i == 0 and ((r0 := manager.get_result("r0", timeout=TIMEOUT_S)) is None
                                       or (retained and not r0.is_finished())):
                pass
            outs += [r0] if lead and i == 0 and retained else []
            t0 = time.perf_counter() if lead and i == 0 else t0
        deadline = time.perf_counter() + TIMEOUT_S
        bar = tqdm(total=len(prompts), desc=f"{kind} requests", mininterval=10)
        while len(outs) + len(errors) < len(prompts) and time.perf_counter() < deadline:
            r = manager.get_result(timeout=1.0)
            if r is not None and (r.is_finished() or r.error):
                (errors if r.error else outs).append(r)
                bar.update(1)
        bar.close()
        manager.stop(block=True)
        pool_peak = store.pool.peak_used if store is not None and store.pool is not None else None
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
    if errors:
        raise RuntimeError(f"{kind}: {len(errors)} requests failed: {errors[0].error}")
    if len(outs) < len(prompts):
        ttft = sorted(round(o.timestamps[0] - o.created_time, 1) for o in outs)
        raise RuntimeError(f"{kind}: {len(prompts) - len(outs)} requests unfinished after {TIMEOUT_S} s (the "
                           f"{len(outs)} finished had their first token after {ttft} s)")
    peak_mem = (torch.cuda.max_memory_allocated() - weights) if cuda else 0
    tokens = sum(len(o.generated_tokens) for o in outs)
    first = min(o.created_time for o in outs)
    last = max(o.timestamps[-1] for o in outs)
    ttft_of = {o.request_id: o.timestamps[0] - o.created_time for o in outs}
    ttft = sorted(ttft_of.values())
    peak, t_a, t_b = concurrency(outs)
    in_window = sum(sum(t_a < s <= t_b for s in o.timestamps) for o in outs)
    # the decode step at that concurrency: gaps between a request's consecutive tokens inside the peak window
    gaps = sorted(b - a for o in outs for a, b in zip(o.timestamps, o.timestamps[1:]) if t_a <= a and b <= t_b)
    row = dict(kind=kind, requests=len(outs), generated_tokens=tokens, makespan_s=round(last - first, 3),
               completed_tok_s=round(tokens / (last - first), 2),
               ttft_p50_s=round(ttft[len(ttft) // 2], 3), ttft_p90_s=round(ttft[int(0.9 * (len(ttft) - 1))], 3),
               peak_concurrency=peak, decode_tok_s_at_peak=round(in_window / (t_b - t_a), 2) if t_b > t_a else None,
               peak_window_s=round(t_b - t_a, 3),
               decode_step_ms_p50=round(1000 * gaps[len(gaps) // 2], 2) if gaps else None,
               decode_steps_timed=len(gaps), cuda_graphs=kind.endswith("-graphs"),
               peak_memory_gib=round(peak_mem / 2**30, 3),
               num_blocks=cb.num_blocks, max_batch_tokens=cb.max_batch_tokens)
    if store is not None:
        row.update(window_slots=store.windows.num_slots, window_gib=round(store.windows.reserved_bytes / 2**30, 3),
                   pool_pages_peak=pool_peak, pool_peak_gib=round(pool_peak * store.page_bytes(PAGE) / 2**30, 3))
    if lead:
        later = sorted(o.timestamps[0] - o.created_time for o in outs if o.request_id != "r0")
        row.update(first_ttft_s=round(ttft_of["r0"], 3), later_ttft_p50_s=round(later[len(later) // 2], 3),
                   later_ttft_p90_s=round(later[int(0.9 * (len(later) - 1))], 3), later_ttfts_s=[
                       round(ttft_of[f"r{i}"], 3) for i in range(1, len(outs))])
        row["later_over_first"] = round(row["later_ttft_p50_s"] / row["first_ttft_s"], 3)
    if steps is not None:
        row["step_trace"] = step_summary(steps, outs, compiles, captures)
        if PROFILES:
            row["step_trace"]["profiles"], PROFILES[:] = list(PROFILES), []
            for prof in row["step_trace"]["profiles"]:
                print(json.dumps(prof), flush=True)
    row["outputs"] = {o.request_id: o.generated_tokens[:8] for o in outs}  # a glimpse, to compare runs
    print(json.dumps({k: v for k, v in row.items() if k not in ("outputs", "step_trace")}), flush=True)
    if steps is not None:
        shown = {k: v for k, v in row["step_trace"].items() if k not in ("later_requests", "compile_variants")}
        print(json.dumps(shown), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", nargs="+", default=["capacity", "load"], choices=["capacity", "load", "prefix"])
    p.add_argument("--kinds", nargs="+", default=["bf16", "oscar"],
                   choices=["bf16", "oscar", "bf16-graphs", "oscar-graphs", "oscar-shared", "oscar-shared-graphs"],
                   help="*-graphs: with Transformers' CUDA graphs (use_cuda_graph=True)")
    p.add_argument("--q-padding", type=int, default=8,
                   help="*-graphs: q_padding_interval_size (a decode step of N requests runs ceil(N / it) * it rows)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="capacity: requests submitted (default: as many as the budget admits at --context)")
    p.add_argument("--kv-budget-gib", type=float, default=40.0)
    p.add_argument("--context", type=int, default=32768, help="capacity: prompt tokens of every request")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-requests", type=int, default=64, help="OSCAR window slots")
    p.add_argument("--requests", type=int, default=32, help="load: requests submitted")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="load: prompt lengths")
    p.add_argument("--rate", type=float, default=0.5, help="load: arrivals per second (Poisson)")
    p.add_argument("--bf16-batch-tokens", type=int, default=2048,
                   help="BF16 max_batch_tokens: sdpa builds a [tokens, all cached tokens] mask each step")
    p.add_argument("--oscar-batch-tokens", type=int, default=None,
                   help="OSCAR max_batch_tokens (default: the longest prompt + max_requests, no chunked prefill)")
    p.add_argument("--prompt-budget", type=int, default=None,
                   help="OSCAR prompt_budget (tokens of split prompts held in full precision, reserved from the KV "
                        "budget; default the model's max_position_embeddings)")
    p.add_argument("--retained", action="store_true", help="prefix: the others arrive after the first has finished")
    p.add_argument("--trace-steps", action="store_true",
                   help="OSCAR: record each step's prompt / decode rows and length; per later request, the steps it "
                        "waited through")
    p.add_argument("--scheduler", default="fifo", choices=["fifo", "prefill_first", "oscar_prefill_apart"],
                   help="every manager's scheduler_type, BF16's too (oscar_prefill_apart: prompt rows in steps of "
                        "their own, oscar_hf.serving.scheduler)")
    p.add_argument("--profile-joiner", type=int, default=0,
                   help="with --trace-steps: profile the k-th joiner's prompt step (torch.profiler: host and GPU "
                        "time, launches, the top ops; in step_trace.profiles); the run's timings are then not results")
    p.add_argument("--warm-kernels", action="store_true",
                   help="OSCAR: compile the read kernels' variants before the measured parts (oscar_hf.serving."
                        "warmup; its calls and seconds in env.kernel_warm_up)")
    p.add_argument("--out")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    longest = max([args.context] + args.lengths)
    model = build_model(args.shape, torch.bfloat16, device, max_pos=longest + args.new_tokens + 16)
    vocab = model.config.vocab_size
    budget = int(args.kv_budget_gib * 2**30)
    oscar_kw = dict(method="hadamard", prompt_budget=args.prompt_budget)  # artifact-free
    oscar_tokens = args.oscar_batch_tokens or longest + args.max_requests
    batch_tokens = {k: args.bf16_batch_tokens if k.startswith("bf16") else oscar_tokens for k in args.kinds}
    rng = random.Random(0)
    doc = dict(env=run_env(argv, triton_cache_files_at_start=triton_cache_files()), shape=SHAPES[args.shape],
               kv_budget_gib=args.kv_budget_gib, results={})

    for kind in args.kinds:  # warm-up, not measured (prefix: also a shared prefix's chunk read, long-history decodes)
        cb, store = cache_configs(model, kind, budget, 1024, 4, oscar_kw, args.q_padding, args.scheduler)
        serve(model, kind, [[rng.randrange(vocab) for _ in range(600)] for _ in range(3)], [0, 0, 0], 8, cb, store)
        if "prefix" in args.parts:
            head, q = [rng.randrange(vocab) for _ in range(args.context)], args.q_padding
            cb, store = cache_configs(model, kind, budget, batch_tokens[kind], args.max_requests, oscar_kw, q,
                                      args.scheduler)
            serve(model, kind, [head + [rng.randrange(vocab) for _ in range(64)] for _ in range(6)],
                  [-1.0] + [0.1 * i for i in range(5)], 16, cb, store)

    if args.warm_kernels:  # once a process: the compiled variants are the kernels' own (every store of a shape)
        warm = doc["env"]["kernel_warm_up"] = {}
        for kind in (k for k in args.kinds if k.startswith("oscar")):
            store = cache_configs(model, kind, budget, batch_tokens[kind], args.max_requests, oscar_kw,
                                  args.q_padding)[1]
            warm[kind] = warm_kernels(store, page_size=PAGE, max_chunk=batch_tokens[kind],
                                      max_history=longest + args.new_tokens)
            print(kind, "kernel warm-up:", json.dumps(warm[kind]), flush=True)

    for i, part in enumerate(args.parts):  # (a part given twice runs again: its rows under "<part>_2", ...)
        seen = args.parts[:i].count(part)
        rows = doc["results"].setdefault(f"{part}_{seen + 1}" if seen else part, {})
        for kind in args.kinds:
            cb, store = cache_configs(model, kind, budget, batch_tokens[kind], args.max_requests, oscar_kw,
                                      args.q_padding, args.scheduler)
            if part == "capacity":
                n = admitted_at(model, kind, store, cb, args.context, args.new_tokens)
                if args.concurrency is not None:
                    if args.concurrency > n:
                        raise SystemExit(f"{kind}: {args.kv_budget_gib} GiB admit {n} requests at {args.context} "
                                         f"tokens, fewer than --concurrency {args.concurrency}")
                    n = args.concurrency
                prompts = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(n)]
                arrivals = [0.0] * n
            elif part == "prefix":
                r = random.Random(2)
                prefix = [r.randrange(vocab) for _ in range(args.context)]
                prompts = [prefix + [r.randrange(vocab) for _ in range(64)] for _ in range(args.requests)]
                arrivals = [-1.0] + [i / args.rate for i in range(args.requests - 1)]
            else:
                r = random.Random(1)  # the same requests for every kind
                prompts = [[r.randrange(vocab) for _ in range(r.choice(args.lengths))] for _ in range(args.requests)]
                gaps = [r.expovariate(args.rate) for _ in range(args.requests)]
                arrivals = [sum(gaps[:i]) for i in range(args.requests)]
            rows[kind] = serve(model, kind, prompts, arrivals, args.new_tokens, cb, store,
                               part == "prefix" and args.retained, args.trace_steps, args.profile_joiner)
            write_json(args.out, doc)
        if {"oscar", "oscar-graphs"} <= rows.keys() and rows["oscar"]["decode_step_ms_p50"]:
            rows["graphs_speedup"] = round(rows["oscar"]["decode_step_ms_p50"]
                                           / rows["oscar-graphs"]["decode_step_ms_p50"], 2)
            print(part, "OSCAR decode step, eager / CUDA graphs:", rows["graphs_speedup"], flush=True)
        if {"bf16", "oscar"} <= rows.keys():
            b, o = rows["bf16"], rows["oscar"]
            rows["ratios"] = dict(
                concurrency=round(o["peak_concurrency"] / b["peak_concurrency"], 2),
                decode_tok_s_at_peak=(round(o["decode_tok_s_at_peak"] / b["decode_tok_s_at_peak"], 2)
                                      if o["decode_tok_s_at_peak"] and b["decode_tok_s_at_peak"] else None),
                completed_tok_s=round(o["completed_tok_s"] / b["completed_tok_s"], 2))
            print(part, "OSCAR / BF16:", json.dumps(rows["ratios"]), flush=True)
            write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
