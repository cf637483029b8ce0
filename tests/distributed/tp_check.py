#!/usr/bin/env python
"""OscarCache under tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``).

    torchrun --nproc-per-node 2 tests/distributed/tp_check.py --layers 8 --context 4096 --out benchmarks/results/tp_h200x2.json

Every rank: (1) rank 0 builds a Qwen3-8B-shaped random-weights model (``--layers`` cuts it short; same seed)
and saves it, plus a random per-head orthogonal rotation artifact with offsets (``--rotations random``; or the
builtin ``hadamard``), to a checkpoint directory; (2) the *single-process reference*: the full model loaded
on this rank's own device without TP, greedy ``generate`` with ``OscarCache`` and with BF16 ``DynamicCache``
on a left-padded batch whose prompt is long enough to have INT2 history; (3) the same model loaded with
``tp_plan="auto"`` (each rank holds ``Hk / world`` KV heads), the same two generations.

Checks (exit status 1 if one fails; rank 0 writes the JSON):

* layout: the KV heads found by ``oscar_hf.distributed`` on each rank are ``[r*Hk/W, (r+1)*Hk/W)``;
* cache contents: per rank and layer, the 2-bit history codes of the TP cache equal the reference cache's
  codes of the same heads (fraction >= ``--min-code-agreement``; only the prompt's tokens are in the
  history while ``new_tokens < recent``, so both runs quantized the same keys up to BF16/all-reduce noise;
  a wrong head slice of a per-head artifact gives ~0.3-0.4). With ``--rotations random`` every rank also
  repeats the OSCAR run with the next rank's slice (negative control): that one must *fail* the comparison,
  or the check proves nothing. ``--wrong-heads`` makes the main run use the wrong slice (the script then exits 1);
* tokens: agreement of the TP tokens with the single-process tokens, for OSCAR and for the BF16 control
  (BF16 itself is not bit-stable across TP: all-reduce order), reported; exact equality is required only
  with ``--strict-tokens``.

Also reported per rank: cache memory (``memory_report()``, BF16 ``DynamicCache`` bytes), peak memory and
median decode ms/token. ``--shape tiny`` runs on CPU with gloo (the CPU test does this).
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (see the device notes)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LogitsProcessorList  # noqa: E402

from oscar_hf import OscarCache, OscarRotations, disable_oscar  # noqa: E402
from oscar_hf.compat import cache_kwargs  # noqa: E402
from oscar_hf.config import ModelFingerprint  # noqa: E402
from oscar_hf.rotations import LayerRotation  # noqa: E402
from oscar_hf.distributed import even_head_shard, slice_layer_rotation  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # bench_generate
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # batch_utils
from batch_utils import cpu_compile_config  # noqa: E402
from bench_generate import SHAPES as _BENCH_SHAPES, StepClock  # noqa: E402

SHAPES = {
    "qwen3-8b": _BENCH_SHAPES["qwen3-8b"],
    # CPU: 4 KV heads so that 2 ranks hold 2 heads each (a slice, not a single index)
    "tiny": dict(model_type="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=512),
}


def log(rank, *msg):
    print(f"[rank {rank}]", *msg, flush=True)


def init_distributed(script: str, dtype_name: str | None):
    """This torchrun rank's ``(device, rank, world, dtype)``: NCCL on its own GPU, else gloo on the CPU; ``dtype``
    ``dtype_name`` or bfloat16 on CUDA, float32 on the CPU."""
    if "RANK" not in os.environ:
        raise SystemExit(f"run under torchrun: torchrun --nproc-per-node 2 tests/distributed/{script} ...")
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    warnings.filterwarnings("ignore", message=".*tp_plan.*")  # deprecated kwarg on 5.17+, still supported
    dtype = getattr(torch, dtype_name) if dtype_name else (torch.bfloat16 if cuda else torch.float32)
    return device, dist.get_rank(), dist.get_world_size(), dtype


def model_config(shape: str, layers: int | None, max_pos: int):
    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    return AutoConfig.for_model(kw.pop("model_type"), max_position_embeddings=max_pos, **kw)


def random_rotations(config, seed: int, offsets: bool = True) -> OscarRotations:
    """Per layer and KV head a different random orthogonal R_K, R_V and offsets mu_K, mu_V (seeded, CPU):
    a wrong head slice changes every quantized code."""
    fp = ModelFingerprint.from_config(config)
    g = torch.Generator().manual_seed(seed)
    hk, d = fp.num_key_value_heads, fp.head_dim

    def orth():
        q, r = torch.linalg.qr(torch.randn(hk, d, d, generator=g, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]).float().contiguous()

    layers = {}
    for i, t in enumerate(fp.layer_types):
        if t != "full_attention":
            continue
        mu = (lambda: 0.05 * torch.randn(hk, d, generator=g)) if offsets else (lambda: None)
        layers[i] = LayerRotation(orth(), orth(), 1.0, 1.0, mu(), mu())
    return OscarRotations(fp, "random", layers, {"seed": seed})


def inputs(config, batch: int, context: int, pad: int, seed: int, device):
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(100, config.vocab_size - 10, (batch, context), generator=g)
    am = torch.ones_like(ids)
    for b in range(1, batch):  # rows 1.. left-padded by pad, 2*pad, ...
        am[b, : min(context - 8, b * pad)] = 0
    ids = ids.masked_fill(am == 0, 0)
    return ids.to(device), am.to(device)


def oscar_state(cache) -> dict[int, dict]:
    """Per quantized layer (either storage, through ``export_state``): history codes (k, v) on
    CPU, pad, sink and tail (full precision)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "hist_k", None) is None or not layer.is_initialized:
            continue
        st = layer.export_state()
        out[i] = dict(codes_k=st["hist_k"].codes.cpu(), codes_v=st["hist_v"].codes.cpu(), pad=st["pad"].cpu(),
                      sink_k=st["sink_k"].float().cpu(), tail_k=st["tail_k"].float().cpu(), heads=layer.num_kv_heads)
    return out


def unpack(codes: torch.Tensor) -> torch.Tensor:
    return torch.stack([(codes >> (2 * p)) & 3 for p in range(4)], -1)


def code_agreement(ref: torch.Tensor, tp: torch.Tensor, pad: torch.Tensor) -> float:
    """Fraction of equal 2-bit codes over the history entries every row actually reads (j >= pad[b])."""
    if ref.shape != tp.shape:
        return float("nan")
    n = ref.shape[2]
    if n == 0:
        return float("nan")
    valid = (torch.arange(n)[None, :] >= pad[:, None])[:, None, :, None, None]  # [B, 1, n, 1, 1]
    eq = (unpack(ref) == unpack(tp)) & valid
    denom = valid.expand_as(eq).sum().item()
    return eq.sum().item() / denom if denom else float("nan")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item() if a.shape == b.shape else float("nan")


def generate(model, ids, am, cache, n, device):
    clock = StepClock()
    extra = dict(compile_config=cpu_compile_config()) if getattr(cache, "compiled", False) and device.type == "cpu" else {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             **cache_kwargs(model, cache), pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]), **extra)
    st = clock.stamps
    steps = sorted(b - a for a, b in zip(st, st[1:]))
    res = dict(tokens=out[:, ids.shape[1]:].cpu(), prefill_s=st[0] - t0,
               decode_ms_per_token=steps[len(steps) // 2] * 1000 if steps else float("nan"),
               compiled_graphs=counters["stats"]["unique_graphs"] - graphs0)  # decode steps compiled by generate
    if device.type == "cuda":
        res["peak_mem_gib_above_weights"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return res


def dynamic_bytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers
               if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4)


def run_both(model, rot_dir, ids, am, a, device, wrong_heads=False, rank=0, world=1, oscar_only=False):
    cache = OscarCache.from_pretrained(rot_dir, model, sink=a.sink, recent=a.recent, compile=True if a.compile else "auto")
    if a.compile and not cache.compiled:
        raise SystemExit("--compile: the cache did not take the compiled storage")
    layout = cache.tp_layout.to_dict() if cache.tp_layout is not None else None
    if wrong_heads:  # negative control: every rank gets the next rank's heads
        hk = cache.fingerprint.num_key_value_heads
        s = even_head_shard(hk, (rank + 1) % world, world)
        for i, layer in enumerate(cache.layers):
            if getattr(layer, "_rotation_cpu", None) is not None:
                layer._rotation_cpu = slice_layer_rotation(cache.rotations.layers[i], s, s)
    osc = generate(model, ids, am, cache, a.new_tokens, device)
    mem = cache.memory_report()
    state = oscar_state(cache)
    disable_oscar(model)
    del cache
    if oscar_only:
        return osc, mem, state, None, layout
    dyn = DynamicCache(config=model.config)
    bf = generate(model, ids, am, dyn, a.new_tokens, device)
    bf["cache_bytes"] = dynamic_bytes(dyn)
    del dyn
    return osc, mem, state, bf, layout


def agreement_by_layer(ref_state, state, heads: slice) -> dict[int, dict]:
    return {i: dict(k=code_agreement(ref_state[i]["codes_k"][:, heads], st["codes_k"], st["pad"]),
                    v=code_agreement(ref_state[i]["codes_v"][:, heads], st["codes_v"], st["pad"]),
                    entries=int(st["codes_k"].shape[2]))
            for i, st in state.items() if i in ref_state}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=8, help="decoder layers (0: the shape's own count)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--pad", type=int, default=None, help="left padding step per row (default context // 4)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--rotations", default="random", choices=["random", "hadamard"])
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: a fresh one under /tmp, removed at the end)")
    p.add_argument("--min-code-agreement", type=float, default=0.8,
                   help="BF16 all-reduce noise flips a few codes in deep layers; a wrong slice gives ~0.3-0.4")
    p.add_argument("--strict-tokens", action="store_true", help="also require OSCAR TP tokens == single-process tokens")
    p.add_argument("--wrong-heads", action="store_true", help="slice the wrong heads in the main run (the check must fail)")
    p.add_argument("--no-negative-control", action="store_true",
                   help="skip the extra TP run with deliberately wrong head slices (random rotations only)")
    p.add_argument("--no-reference", action="store_true", help="skip the single-process reference (TP run only)")
    p.add_argument("--compile", action="store_true",
                   help="OscarCache(compile=True) in both runs: the compiled storage, generate compiling the decode step "
                        "(on the CPU through dynamo with the eager backend)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.new_tokens >= a.recent:
        p.error("--new-tokens must stay below --recent (the history then holds prompt tokens only)")
    if a.context <= a.sink + a.recent + 64:
        p.error(f"--context must exceed sink + recent (+64) = {a.sink + a.recent + 64} to have INT2 history")

    device, rank, world, dtype = init_distributed("tp_check.py", a.dtype)
    cuda = device.type == "cuda"

    cfg = model_config(a.shape, a.layers or None, a.context + a.new_tokens + 16)
    hk = cfg.num_key_value_heads
    if hk % world:
        raise SystemExit(f"{hk} KV heads cannot be split over {world} ranks")
    own_ckpt = a.ckpt is None
    box = [tempfile.mkdtemp(prefix="oscar_tp_") if rank == 0 and own_ckpt else a.ckpt]
    dist.broadcast_object_list(box, src=0)
    ckpt = Path(box[0])
    rot_dir = ckpt / "oscar_rotations"
    if rank == 0 and not (ckpt / "config.json").is_file():
        t0 = time.perf_counter()
        torch.manual_seed(a.seed)
        with torch.device(device):
            m = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        m.save_pretrained(ckpt)
        del m
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        log(rank, f"built and saved the random model in {time.perf_counter() - t0:.1f}s -> {ckpt}")
    if rank == 0:
        rot = random_rotations(cfg, a.seed) if a.rotations == "random" else OscarRotations.builtin(cfg, "hadamard")
        rot.save_pretrained(rot_dir)
    dist.barrier()

    pad = a.pad if a.pad is not None else a.context // 4
    ids, am = inputs(cfg, a.batch, a.context, pad, a.seed, device)
    res = dict(rank=rank, world=world, device=torch.cuda.get_device_name(device) if cuda else "cpu",
               torch=torch.__version__, transformers=__import__("transformers").__version__)

    # ---- single-process reference on this rank's own device (no TP)
    ref = None
    if not a.no_reference:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, device_map=device, attn_implementation="sdpa").eval()
        osc, mem, state, bf, _ = run_both(model, rot_dir, ids, am, a, device)
        ref = dict(oscar=osc, bf16=bf, state=state)
        res["single"] = dict(oscar_ms_per_token=osc["decode_ms_per_token"], bf16_ms_per_token=bf["decode_ms_per_token"],
                             oscar_cache_bytes=mem["total"], bf16_cache_bytes=bf["cache_bytes"])
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        log(rank, f"single-process reference done in {time.perf_counter() - t0:.1f}s")
    dist.barrier()

    # ---- tensor parallel
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, tp_plan="auto", attn_implementation="sdpa").eval()
    res["tp_size"] = getattr(model, "tp_size", None)
    kw = model.model.layers[0].self_attn.k_proj.weight
    res["k_proj_weight"] = dict(type=type(kw).__name__, placements=str(getattr(kw, "placements", None)),
                                local_rows=int(kw.to_local().shape[0]) if hasattr(kw, "to_local") else int(kw.shape[0]))
    osc, mem, state, bf, layout = run_both(model, rot_dir, ids, am, a, device, a.wrong_heads, rank, world)
    log(rank, f"tensor-parallel run done in {time.perf_counter() - t0:.1f}s")
    res["tp_layout"] = layout
    res["tp"] = dict(oscar_ms_per_token=osc["decode_ms_per_token"], bf16_ms_per_token=bf["decode_ms_per_token"],
                     oscar_prefill_s=osc["prefill_s"], bf16_prefill_s=bf["prefill_s"],
                     oscar_memory_report={k: float(v) for k, v in mem.items()}, bf16_cache_bytes=bf["cache_bytes"],
                     oscar_peak_mem_gib=osc.get("peak_mem_gib_above_weights"), bf16_peak_mem_gib=bf.get("peak_mem_gib_above_weights"),
                     oscar_tokens=osc["tokens"].tolist(), bf16_tokens=bf["tokens"].tolist(),
                     oscar_compiled_graphs=osc["compiled_graphs"])
    res["cache_heads_per_layer"] = sorted({s["heads"] for s in state.values()})

    # ---- checks on this rank
    problems = []
    want = even_head_shard(hk, rank, world)
    if layout is None:
        problems.append("OscarCache did not detect tensor parallelism (tp_layout is None)")
    else:
        for kind in ("k", "v"):
            bad = {i: s for i, s in layout[kind].items() if tuple(s) != (want.start, want.stop)}
            if bad:
                problems.append(f"{kind} heads {bad} differ from the column-sharded layout [{want.start}, {want.stop})")
    if ref is not None:
        sl = slice(want.start, want.stop)
        agree = agreement_by_layer(ref["state"], state, sl)
        res["history_code_agreement"] = agree
        res["window_rel_err"] = {i: dict(sink_k=rel_err(st["sink_k"], ref["state"][i]["sink_k"][:, sl]),
                                         tail_k=rel_err(st["tail_k"], ref["state"][i]["tail_k"][:, sl]))
                                 for i, st in state.items() if i in ref["state"]}
        if not agree or set(agree) != set(ref["state"]):
            problems.append(f"quantized layers with history: TP {sorted(state)}, reference {sorted(ref['state'])}")
        for i, ag in agree.items():
            for kind in ("k", "v"):
                if not ag[kind] >= a.min_code_agreement:
                    problems.append(f"layer {i} {kind}: history code agreement {ag[kind]:.3f} < {a.min_code_agreement}")
        for k in ("oscar", "bf16"):
            t_tp = osc["tokens"] if k == "oscar" else bf["tokens"]
            t_ref = ref[k]["tokens"]
            res[f"{k}_tp_equals_single"] = bool(torch.equal(t_tp, t_ref))
            res[f"{k}_token_agreement"] = (t_tp == t_ref).float().mean().item()
            res[f"{k}_single_tokens"] = t_ref.tolist()
        if a.strict_tokens and not res["oscar_tp_equals_single"]:
            problems.append("OSCAR TP tokens differ from the single-process tokens (--strict-tokens)")
        if a.rotations == "random" and world > 1 and not a.no_negative_control and not a.wrong_heads:
            # The same comparison with the next rank's rotations must fail, or it proves nothing.
            _, _, bad_state, _, _ = run_both(model, rot_dir, ids, am, a, device, True, rank, world, oscar_only=True)
            neg = agreement_by_layer(ref["state"], bad_state, sl)
            worst = max((max(v["k"], v["v"]) for v in neg.values()), default=float("nan"))
            res["negative_control_max_code_agreement"] = worst
            if not worst < a.min_code_agreement:
                problems.append(f"negative control: wrong head slices still agree {worst:.3f} >= {a.min_code_agreement}; "
                                "the code comparison cannot tell a wrong slice")
    res["problems"] = problems

    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    ok = all(not g["problems"] for g in gathered)
    if rank == 0:
        summary = dict(ok=ok, shape=a.shape, layers=cfg.num_hidden_layers, context=a.context, batch=a.batch, pad_step=pad,
                       new_tokens=a.new_tokens, sink=a.sink, recent=a.recent, rotations=a.rotations, dtype=str(dtype),
                       wrong_heads=a.wrong_heads, compiled=a.compile, world=world, ranks=gathered)
        for k in ("oscar_token_agreement", "bf16_token_agreement", "oscar_tp_equals_single", "bf16_tp_equals_single"):
            if k in gathered[0]:
                summary[k] = gathered[0][k]  # identical on every rank (lm_head output is gathered)
        summary["min_history_code_agreement"] = min(
            (min(v["k"], v["v"]) for g in gathered for v in g.get("history_code_agreement", {}).values()), default=None)
        summary["negative_control_max_code_agreement"] = max(
            (g["negative_control_max_code_agreement"] for g in gathered if "negative_control_max_code_agreement" in g),
            default=None)
        text = json.dumps(summary, indent=2, default=str)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(text)
        brief = {k: summary[k] for k in summary if k != "ranks"}
        brief["problems"] = {g["rank"]: g["problems"] for g in gathered if g["problems"]}
        print(json.dumps(brief, default=str), flush=True)
    dist.barrier()
    if rank == 0 and own_ckpt:
        shutil.rmtree(ckpt, ignore_errors=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
