#!/usr/bin/env python
"""Soak of OSCAR serving: many requests with cancellations and model switches through ``oscar_serving`` (what
``scripts/serve.py`` / ``transformers serve`` run: a fresh store per manager, per model).

    python benchmarks/serving_soak.py --out serving_soak.json                  # GPU: 1,000 requests, two models
    python benchmarks/serving_soak.py --tiny --device cpu --out /tmp/s.json    # CPU: tiny models, 120 requests

Two random-weight models of different shapes (A: Llama, B: Qwen3; a model switch stops one's manager and starts the
other's, as a server that changes the loaded model does), ``--rounds`` rounds alternating A, B, A, ... Each round
starts a manager, submits ``--requests / --rounds`` requests of random prompt lengths (``--min-prompt`` ..
``--max-prompt``) and answer lengths (1 .. ``--max-new``), cancels every ``--cancel-every``-th right after it is
sent and another share once its first token has come (cancelled while decoding), collects the rest, and stops the
manager. Checks (exit status 1 if one fails):

* every request not cancelled finishes with exactly its ``max_new_tokens`` tokens, and no request fails;
* after each round the round's store holds no request, no page, no window slot and no prompt reservation, and once the
  manager is dropped the store itself is garbage (a weak reference) -- nothing of a model outlives its manager;
* memory comes back: ``torch.cuda.memory_allocated`` after each round within ``--mem-tol-mib`` of its value after the
  first round of the same model (CUDA), and the number of live tensors (``gc``) likewise (every device). The CUDA
  figure is taken after ``torch._C._cuda_clearCublasWorkspaces()``: PyTorch keeps one cuBLAS workspace (32 MiB on
  sm_90) per (cuBLAS handle, stream) for the process's life, and every manager computes on streams of its own, so each
  round adds one until torch's stream pool (32 streams a device) comes round again -- a bounded cache of PyTorch's,
  not a leak of the manager or the store. Both figures are recorded (``memory_mib``, ``memory_mib_raw``).

Writes every round's record to ``--out`` (JSON).
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
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from oscar_hf.serving import continuous_batching_config, oscar_serving

MiB = 2**20
SHAPES = {  # (A, B): two model types of different shapes (a switch changes every tensor's size)
    "soak": (dict(model_type="llama", hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000),
             dict(model_type="qwen3", hidden_size=768, intermediate_size=1536, num_hidden_layers=3,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=128, vocab_size=32000)),
    "tiny": (dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256),
             dict(model_type="qwen3", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256)),
}
DEFAULTS = dict(requests=1000, rounds=10, min_prompt=16, max_prompt=2048, max_new=32, cancel_every=5,
                sink=64, recent=128, group_size=64, page_size=64, num_blocks=2048, max_batch_tokens=1024,
                max_requests=32)
TINY = dict(requests=120, rounds=6, min_prompt=3, max_prompt=60, max_new=6, cancel_every=5, sink=4, recent=8,
            group_size=32, page_size=8, num_blocks=128, max_batch_tokens=32, max_requests=8)


def build(spec: dict, device, dtype, seed: int):
    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, max_position_embeddings=8192)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device).eval()


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on some library objects warns of deprecations)
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def serve_round(model, stores, args, rng: random.Random, n: int) -> dict:
    """One manager's life: ``n`` requests, cancellations, then stop; what its store held after."""
    cb = continuous_batching_config(num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens,
                                    page_size=args.page_size)
    gen = GenerationConfig(max_new_tokens=args.max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    vocab = model.config.vocab_size
    wanted, cancelled = {}, set()
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        new = rng.randint(1, args.max_new)
        rid = manager.add_request(prompt, max_new_tokens=new)
        wanted[rid] = new
        if i % args.cancel_every == 0:  # cancelled right after it was sent (maybe before its prefill)
            manager.cancel_request(rid)
            cancelled.add(rid)
    late = [rid for rid in wanted if rid not in cancelled and wanted[rid] > 1][: max(1, n // (2 * args.cancel_every))]
    got, errors, deadline = {}, [], time.monotonic() + args.timeout
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny models and lengths (the CPU test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {v} ({TINY[k]} with --tiny)")
    p.add_argument("--mem-tol-mib", type=float, default=16.0)
    p.add_argument("--tensor-tol", type=int, default=64, help="allowed growth of the live tensor count")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per round")
    p.add_argument("--out")
    args = p.parse_args(argv)
    for k, v in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"
    specs = SHAPES["tiny" if args.tiny else "soak"]
    models = [build(s, device, dtype, args.seed + i) for i, s in enumerate(specs)]
    rng = random.Random(args.seed)
    per_round = args.requests // args.rounds
    records, first = [], {}
    kw = dict(max_requests=args.max_requests, method="hadamard", sink=args.sink, recent=args.recent,
              group_size=args.group_size)
    with oscar_serving(**kw) as stores:
        for r in tqdm(range(args.rounds), desc="rounds"):
            which = r % 2
            rec = serve_round(models[which], stores, args, rng, per_round)
            rec.update(round=r, model="AB"[which], live_tensors=live_tensors(), stores_alive=len(stores))
            if cuda:
                raw = torch.cuda.memory_allocated()
                torch._C._cuda_clearCublasWorkspaces()  # (PyTorch's per-stream cuBLAS workspaces: see the docstring)
                rec.update(memory_mib_raw=round(raw / MiB, 2), memory_mib=round(torch.cuda.memory_allocated() / MiB, 2))
            first.setdefault(which, rec)
            records.append(rec)
    checks = {}

    def check(name, ok, detail):
        checks[name] = dict(ok=bool(ok), detail=detail)

    check("no_errors", not any(r["errors"] for r in records), [r["errors"] for r in records if r["errors"]])
    check("lengths", not any(r["wrong_lengths"] or r["missing"] for r in records),
          [(r["round"], r["wrong_lengths"], r["missing"]) for r in records if r["wrong_lengths"] or r["missing"]])
    check("cancelled_some", all(r["cancelled"] > 0 for r in records), [r["cancelled"] for r in records])
    check("nothing_held_after_stop", all(not any(r["held_after_stop"].values()) for r in records),
          [(r["round"], r["held_after_stop"]) for r in records if any(r["held_after_stop"].values())])
    check("stores_released", all(r["store_released"] and r["stores_alive"] == 0 for r in records),
          [(r["round"], r["store_released"], r["stores_alive"]) for r in records])
    grow = [r["live_tensors"] - first[r["round"] % 2]["live_tensors"] for r in records]
    check("live_tensors_flat", max(grow) <= args.tensor_tol, grow)
    if cuda:
        mem = [r["memory_mib"] - first[r["round"] % 2]["memory_mib"] for r in records]
        check("memory_flat", max(mem) <= args.mem_tol_mib, mem)
        checks["memory_flat"]["raw_growth_mib"] = [r["memory_mib_raw"] - first[r["round"] % 2]["memory_mib_raw"]
                                                   for r in records]
    ok = all(c["ok"] for c in checks.values())
    result = dict(ok=ok, checks=checks, rounds=records, args=vars(args),
                  env=dict(torch=torch.__version__, python=platform.python_version(),
                           gpu=torch.cuda.get_device_name() if cuda else None, command=" ".join(sys.argv)))
    print(json.dumps(dict(ok=ok, failed=[k for k, c in checks.items() if not c["ok"]],
                          requests=sum(r["requests"] for r in records),
                          cancelled=sum(r["cancelled"] for r in records))))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
