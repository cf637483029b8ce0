#!/usr/bin/env python
"""OSCAR serving (Transformers' continuous batching through ``paged_oscar``) under tensor parallelism.

    torchrun --nproc-per-node 2 tests/distributed/tp_serving_check.py --shape qwen3-8b --layers 8 --out tp_serving.json
    torchrun --nproc-per-node 2 tests/distributed/tp_serving_check.py --shape tiny    # CPU, gloo (the CPU test does this)

Every rank: rank 0 saves a random-weights model of ``--shape`` and a random per-head rotation artifact with offsets
(``tp_check.random_rotations``), one retrieval head (``--retrieval-head L H``, INT8) included; then (1) the
single-process reference: the whole model on this rank's device, ``generate_batch`` inside ``paged_oscar``; (2) the
model loaded with ``tp_plan="auto"``, the same ``generate_batch`` inside ``paged_oscar``, and plain BF16
``generate_batch`` under TP.

Checks (exit status 1 if one fails; rank 0 writes the JSON):

* the store holds this rank's KV heads: ``Hk / W`` heads, per layer exactly the artifact's rotations and offsets of
  heads ``[r*Hk/W, (r+1)*Hk/W)``, the retrieval head as a local id on the rank that holds it and nowhere else;
* the TP tokens equal the single-process tokens (required with ``--strict-tokens``, the CPU test's float32 setting;
  reported otherwise: BF16 all-reduces are not bit-stable);
* OSCAR was in the loop: some request's tokens differ from BF16 serving's under TP (reported);
* every page and window slot is back in the pool after the batch.
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (see the device notes)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

from oscar_hf import OscarRotations  # noqa: E402
from oscar_hf.serving import continuous_batching_config, paged_oscar  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tp_check
from tp_check import SHAPES, init_distributed, log, model_config, random_rotations  # noqa: E402


def serve(model, prompts, new_tokens, page_size, oscar: dict | None):
    """``{request: tokens}`` of one ``generate_batch`` (inside ``paged_oscar(model, **oscar)`` unless None), the
    store's facts and the seconds it took."""
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = continuous_batching_config(num_blocks=256, max_batch_tokens=256, page_size=page_size)
    t0 = time.perf_counter()
    store_facts = None
    if oscar is None:
        out = model.generate_batch(prompts, gen, continuous_batching_config=cb, warmup=False)
    else:
        with paged_oscar(model, **oscar) as store:
            out = model.generate_batch(prompts, gen, continuous_batching_config=cb, warmup=False)
            store_facts = dict(num_kv_heads=store.num_kv_heads, num_query_heads=store.num_query_heads,
                               pages_left=store.pool.num_used, requests_left=len(store.requests),
                               peak_pages=store.pool.peak_used,
                               rotations={i: r for i, r in store._rotations_cpu.items()},
                               retrieval_heads={i: list(p.coded_heads) for i, p in store.params.items()},
                               tp_layout=store.tp_layout.to_dict() if store.tp_layout is not None else None)
    tokens = {k: list(v.generated_tokens) for k, v in sorted(out.items())}
    return tokens, store_facts, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=8, help="decoder layers (0: the shape's own count)")
    p.add_argument("--prompts", type=int, nargs="+", default=[24, 61, 37, 90, 15], help="prompt lengths")
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--sink", type=int, default=8)
    p.add_argument("--recent", type=int, default=16)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--page-size", type=int, default=8)
    p.add_argument("--retrieval-head", type=int, nargs=2, default=[0, 3], metavar=("LAYER", "HEAD"),
                   help="one retrieval head (INT8), global KV head id: only the rank holding it keeps it")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict-tokens", action="store_true", help="require TP tokens == single-process tokens")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device, rank, world, dtype = init_distributed("tp_serving_check.py", a.dtype)
    cuda = device.type == "cuda"

    cfg = model_config(a.shape, a.layers or None, max(a.prompts) + a.new_tokens + 16)
    hk = cfg.num_key_value_heads
    if hk % world:
        raise SystemExit(f"{hk} KV heads cannot be split over {world} ranks")
    box = [tempfile.mkdtemp(prefix="oscar_tp_serving_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ckpt = Path(box[0])
    if rank == 0:
        torch.manual_seed(a.seed)
        with torch.device(device):
            AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").save_pretrained(ckpt)
        random_rotations(cfg, a.seed).save_pretrained(ckpt / "oscar_rotations")
    dist.barrier()
    rot = OscarRotations.from_pretrained(ckpt / "oscar_rotations")
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(1, cfg.vocab_size) for _ in range(n)] for n in a.prompts]
    layer, head = a.retrieval_head
    oscar = dict(rotations=rot, sink=a.sink, recent=a.recent, group_size=a.group_size,
                 retrieval_heads=((layer, head),), retrieval_bits=8)
    res = dict(rank=rank, world=world, device=torch.cuda.get_device_name(device) if cuda else "cpu",
               torch=torch.__version__, transformers=__import__("transformers").__version__)

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, device_map=device, attn_implementation="sdpa").eval()
    single, single_store, res["single_s"] = serve(model, prompts, a.new_tokens, a.page_size, oscar)
    del model
    gc.collect()
    log(rank, "single-process reference done")

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, tp_plan="auto", attn_implementation="sdpa").eval()
    tp, store, res["tp_s"] = serve(model, prompts, a.new_tokens, a.page_size, oscar)
    bf16, _, res["bf16_tp_s"] = serve(model, prompts, a.new_tokens, a.page_size, None)
    log(rank, "tensor-parallel runs done")

    problems = []
    n = hk // world
    own = slice(rank * n, (rank + 1) * n)
    if store["num_kv_heads"] != n or single_store["num_kv_heads"] != hk:
        problems.append(f"store heads: TP {store['num_kv_heads']} (want {n}), single {single_store['num_kv_heads']}")
    for i, r in store["rotations"].items():
        full = rot.layers[i]
        for name in ("r_k", "r_v", "mu_k", "mu_v"):
            if not torch.equal(getattr(r, name), getattr(full, name)[own]):
                problems.append(f"layer {i} {name}: not the artifact's heads {own.start}:{own.stop}")
    want_heads = {i: [] for i in store["rotations"]}
    if own.start <= head < own.stop:
        want_heads[layer] = [head - own.start]
    if store["retrieval_heads"] != want_heads:
        problems.append(f"retrieval heads {store['retrieval_heads']}, want {want_heads}")
    if store["pages_left"] or store["requests_left"]:
        problems.append(f"{store['pages_left']} pages / {store['requests_left']} requests left after the batch")
    res.update(store_heads=store["num_kv_heads"], query_heads=store["num_query_heads"], peak_pages=store["peak_pages"],
               retrieval_heads=store["retrieval_heads"], tp_layout=store["tp_layout"], tokens_tp=tp,
               tokens_single=single, tokens_bf16_tp=bf16, tp_equals_single=tp == single,
               oscar_differs_from_bf16=tp != bf16)
    if a.strict_tokens and tp != single:
        problems.append("TP tokens differ from the single-process tokens")
    res["problems"] = problems

    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    ok = all(not g["problems"] for g in gathered)
    if rank == 0:
        summary = dict(ok=ok, shape=a.shape, layers=cfg.num_hidden_layers, prompts=a.prompts, new_tokens=a.new_tokens,
                       sink=a.sink, recent=a.recent, group_size=a.group_size, page_size=a.page_size,
                       retrieval_head=a.retrieval_head, dtype=str(dtype), world=world,
                       tp_equals_single=all(g["tp_equals_single"] for g in gathered),
                       oscar_differs_from_bf16=gathered[0]["oscar_differs_from_bf16"],
                       problems={g["rank"]: g["problems"] for g in gathered if g["problems"]}, ranks=gathered,
                       command="torchrun --nproc-per-node %d tests/distributed/tp_serving_check.py " % world
                               + " ".join(argv if argv is not None else sys.argv[1:]))
        print(json.dumps({k: v for k, v in summary.items() if k != "ranks"}))
        if a.out:
            Path(a.out).write_text(json.dumps(summary, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
