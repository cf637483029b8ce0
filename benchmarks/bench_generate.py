#!/usr/bin/env python
"""End-to-end decode speed and KV memory in `generate` on a random-initialised model of a real shape
(default Qwen3-8B: 36 layers, 32 query / 8 KV heads, head_dim 128; ``--shape``: the ``SHAPES`` below, among them
Gemma 3 12B (sliding 5 : full 1, head_dim 256), gpt-oss-20b (sliding / full, attention sinks, head_dim 64, eager
attention), Qwen3-Next and Qwen3.5-9B (linear attention 3 : full 1, head_dim 256), Llama 3.2 1B (head_dim 64)).
Methods (``--methods``):

* ``bf16-strong``: the strong BF16 baseline (``strong_bf16.py``): a static cache whose decode step reads the
  un-repeated K/V over the live length only (a split-K Triton kernel, the length on the device), compiled by
  ``generate`` with CUDA graphs as ``OscarCache`` is; ``bf16-strong-flex``: the same read by FlexAttention;
  what Transformers gives you today:
* ``bf16``: BF16 ``DynamicCache``, SDPA, eager;
* ``bf16-static``: ``cache_implementation="static"`` (``generate`` compiles the decode step:
  ``torch.compile(mode="reduce-overhead")``, CUDA graphs; its mask over the whole capacity makes SDPA repeat K/V
  for GQA);
* ``oscar``: ``OscarCache(model, ...)``, the default call: on CUDA its storage is device-resident and ``generate``
  compiles the decode step by itself (like bf16-static); ``oscar-eager``: ``OscarCache(compile=False)``, every
  forward eager; ``oscar-static``: ``StaticOscarCache`` (a fixed ``max_cache_len``);
  ``oscar-compiled``: ``OscarCache(compile=True)``, the compiled storage also for the models where the default call
  keeps the eager storage on CUDA (hybrid, MLA, KV-sharing, soft-capped); ``oscar-skipN``: the first N layers kept in
  full precision (``skip_layers``);
  ``oscar-fpN``: ``OscarCache`` with N retrieval heads (``retrieval_heads``, spread over the layers), stored
  as the library stores them (INT8); ``oscar-fpN-serial``: their read on the layer's stream, not on its side stream;
  ``oscar-fpN-apart``: their rows merged by a combine of their own, then copied in (``HeadsDefaults.merged`` off);
  ``<oscar method>-beside`` / ``-joined``: the decode step's write split at every batch, its demotion on a side
  stream beside the read / one write launch at every batch (the default: split up to
  ``WriteDefaults.beside_max_batch``).

Every figure is a ratio against the baselines measured in the same run: ``speedup_vs_bf16_strong`` first, then
``speedup_vs_bf16`` (DynamicCache) and ``speedup_vs_bf16_static``.

    python benchmarks/bench_generate.py --contexts 8192 32768 100000 --batches 1 8 --out generate.json

Per (method, batch, context): prefill time, decode ms/token and tokens/s (timestamps taken by a
logits processor at every generate step, after a CUDA sync), peak memory
(``torch.cuda.max_memory_allocated`` minus the weights) and cache bytes. Then capacity: the largest
batch at ``--capacity-context`` that fits ``--kv-budget-gib`` for BF16 and for OSCAR (from the
measured bytes per token), and the aggregate decode throughput of each at that batch.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from oscar_hf import OscarCache, StaticOscarCache  # noqa: E402
from oscar_hf.compat import cache_kwargs, returned_cache  # noqa: E402
from oscar_hf.kernels import settings  # noqa: E402

torch._dynamo.config.cache_size_limit = 64  # one compiled decode step per (method, batch, context)
# A second (batch, context) in the same process would otherwise be recompiled with symbolic sizes, which failed in
# inductor on the H100 (torch 2.11) for StaticCache and StaticOscarCache alike; each shape gets its own static graph.
torch._dynamo.config.automatic_dynamic_shapes = False
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 64

# Config fields of each shape (random weights), plus ``attn_implementation`` (default "sdpa") and a ``note``, which
# build_model takes out. ``max_position_embeddings`` is raised to the longest context + new tokens where it is smaller.
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]  # full attention every 6th layer, from index 5
QWEN3_NEXT_LAYERS = ["linear_attention"] * 3 + ["full_attention"]  # full attention every 4th layer, from index 3
SHAPES = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000),
    # google/gemma-3-12b-it's text model (40 sliding layers of 1024 tokens, 8 full)
    "gemma3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                       sliding_window=1024, layer_types=GEMMA3_LAYERS * 8, vocab_size=262208,
                       max_position_embeddings=131072,
                       rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                        "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
    # openai/gpt-oss-20b (rope: the config class's default YaRN, which is gpt-oss's). Transformers runs its attention
    # sinks in "eager" attention only (not SDPA): a prompt's prefill materializes [B, 64, T, T] scores, so long
    # contexts need --synthetic-fill
    "gpt-oss-20b": dict(model_type="gpt_oss", attn_implementation="eager", hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
                        num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, max_position_embeddings=131072),
    # Qwen/Qwen3-Next-80B-A3B: the real attention and linear-attention (Gated DeltaNet) layers, embeddings and router
    # top-k, with the MoE reduced from 512 to 64 experts so that BF16 weights fit one 80 GB GPU (~24 GB). At B=8 a
    # step still reads about as many expert weights as the real model's (8 x 10 picks touch ~all 64 experts here,
    # ~74 of 512 there); at B=1 the same 10 experts.
    "qwen3-next-small": dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
                             num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                             layer_types=QWEN3_NEXT_LAYERS * 12, linear_num_key_heads=16, linear_num_value_heads=32,
                             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                             num_experts=64, num_experts_per_tok=10, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512, vocab_size=151936, max_position_embeddings=262144,
                             rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
                             note="MoE reduced: 64 experts instead of 512 (fits 80 GB in BF16); the attention, "
                                  "linear-attention, embedding and router shapes are Qwen3-Next-80B-A3B's"),
    # Qwen/Qwen3.5-9B's text model (dense; the vision tower left out): 24 Gated DeltaNet layers, 8 full attention
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, layer_types=QWEN3_NEXT_LAYERS * 8,
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
                       max_position_embeddings=262144,
                       rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)),
    # meta-llama/Llama-3.2-1B: full attention at head_dim 64
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072,
                         rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # google/gemma-2-9b: sliding (4096) / full alternating (the config's default layer_types), head_dim 256, logit
    # soft-capping (attention 50, final 30); Transformers runs soft-capping in "eager" attention only
    "gemma2-9b": dict(model_type="gemma2", attn_implementation="eager", hidden_size=3584, intermediate_size=14336,
                      num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                      query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, vocab_size=256000),
    # google/gemma-3n-E4B's text model (Gemma3nTextConfig's defaults): 35 layers (sliding 512 : full 4 : 1), the last
    # 15 reusing the K/V of layers 18 (sliding) and 19 (full, the "store" layer: full precision); OSCAR quantizes
    # full layers 4, 9, 14
    "gemma3n-e4b": dict(model_type="gemma3n_text", max_position_embeddings=131072),
    # Falcon-H1 (FalconH1Config's defaults: 32 "hybrid" layers, attention 32 / 8 heads of 128 beside a Mamba-2 mixer
    # in each; Transformers' torch path of the Mamba mixer where mamba-ssm is not installed)
    "falcon-h1": dict(model_type="falcon_h1", max_position_embeddings=131072),
}
# Qwen3-8B's layers, 18 of its 36: the strong BF16's K/V at B=32 x 32K (77 GB) fits one H200 beside the weights
SHAPES["qwen3-8b-18l"] = dict(SHAPES["qwen3-8b"], num_hidden_layers=18)


class StepClock(LogitsProcessor):
    """Records a synchronized timestamp at every generation step (the first one ends the prefill)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return scores


def build_model(shape: str, dtype, device, max_pos: int):
    kw = dict(SHAPES[shape])
    kw.pop("note", None)
    attn = kw.pop("attn_implementation", "sdpa")
    kw["max_position_embeddings"] = max(kw.get("max_position_embeddings", 0), max_pos)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)  # the same random weights in every run of a shape
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    return model.eval()


def _tensor_bytes(obj, seen: set, depth: int = 0) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` (tensors, containers, and the attributes of
    small objects such as a cache layer's)."""
    if depth > 4 or obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key in seen:
            return 0
        seen.add(key)
        return st.nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        return sum(_tensor_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def cache_bytes(cache) -> int:
    """OSCAR: its memory report (codes + metadata + windows, sliding layers included) and the state of its
    linear-attention layers, which the report leaves out. Others: every tensor the cache holds (for static caches that
    is the preallocated capacity, which is what they occupy)."""
    seen: set = set()
    if isinstance(cache, OscarCache):
        return int(cache.memory_report()["total"]) + sum(_tensor_bytes(layer, seen) for layer in cache.layers
                                                          if _is_state_layer(layer))
    return sum(_tensor_bytes(layer, seen) for layer in cache.layers)


def _is_state_layer(layer) -> bool:
    """A linear-attention / SSM / conv layer of Transformers: a recurrent state, no per-token K/V rows."""
    from transformers.cache_utils import CacheLayerMixin

    return not isinstance(layer, CacheLayerMixin) and hasattr(layer, "recurrent_states")


def synthetic_fill(model, cache, batch: int, context: int, device, chunk: int = 1024) -> None:
    """Leave in every layer what a prefill of ``context`` tokens would: random K/V rows through the cache's own write
    path, chunk by chunk (decode speed does not depend on the values; a 64 x 32K prompt's activations would not fit).
    Sliding layers get the rows they keep, their count set to ``context``; linear-attention layers are left to
    ``generate``'s first forward (the prompt's last token), which leaves the state a prefill leaves."""
    from oscar_hf.cache import DummyLayer, OscarLayer
    from strong_bf16 import StrongBF16Cache
    from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

    cfg = model.config.get_text_config(decoder=True)
    hk, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator(device=device).manual_seed(0)
    if isinstance(cache, StrongBF16Cache):  # its buffers hold the rows as they are; one length for all layers
        for layer in cache.layers:
            for c0 in range(0, context, chunk):
                k, v = (torch.randn(batch, hk, min(chunk, context - c0), d, device=device, dtype=model.dtype,
                                    generator=g) for _ in "kv")
                if not layer.is_initialized:
                    layer.lazy_initialization(k, v)
                layer.keys[:, :, c0 : c0 + k.shape[2]] = k
                layer.values[:, :, c0 : c0 + k.shape[2]] = v
        cache.length.fill_(context)
        return
    for layer in tqdm(cache.layers, desc="synthetic fill", leave=False):
        if _is_state_layer(layer) or (DummyLayer is not None and isinstance(layer, DummyLayer)):
            continue  # (state layers have no K/V rows; KV sharing's reuse layers cache nothing)
        if isinstance(layer, (DynamicSlidingWindowLayer, StaticSlidingWindowLayer)):
            keep = layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else layer.max_cache_len
            n = min(keep + 1, context)  # one row more than it keeps: the layer takes them as a prefill overflowing it
            layer.update(torch.randn(batch, hk, n, d, device=device, dtype=model.dtype, generator=g),
                         torch.randn(batch, hk, n, d, device=device, dtype=model.dtype, generator=g))
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.cumulative_length = context
            else:  # (its device count serves only until full, and an overflowing prefill leaves it as it was)
                layer.cumulative_length_int = context
            continue
        step = chunk if isinstance(layer, OscarLayer) or hasattr(layer, "max_cache_len") else context
        for c0 in range(0, context, step):
            n = min(step, context - c0)
            k = torch.randn(batch, hk, n, d, device=device, dtype=model.dtype, generator=g)
            v = torch.randn(batch, hk, n, d, device=device, dtype=model.dtype, generator=g)
            if isinstance(layer, OscarLayer):
                layer.write(k, v)
            else:  # DynamicLayer / StaticLayer
                layer.update(k, v)


def make_cache(model, method: str, capacity: int, explicit: bool = False):
    """The cache object of ``method`` (``capacity`` = prompt + new tokens, what the static caches preallocate),
    or None for BF16 static without ``explicit`` (``generate(cache_implementation="static")`` builds it).
    ``explicit``: always a cache object (BF16 static as a ``StaticCache``), e.g. to fill it before ``generate``."""
    if method == "bf16":
        return DynamicCache(config=model.config)
    if method.startswith("bf16-strong"):
        from strong_bf16 import StrongBF16Cache

        return StrongBF16Cache(model, capacity, read=method.removeprefix("bf16-strong").lstrip("-") or "split")
    if method == "bf16-static" and explicit:
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=capacity)
    if method == "bf16-static":
        return None
    method = method.removesuffix("-beside").removesuffix("-joined")  # (the write's split: run_one)
    if method == "oscar":
        return OscarCache(model, method="hadamard", group_size=64)
    if method == "oscar-eager":
        return OscarCache(model, method="hadamard", group_size=64, compile=False)
    if method == "oscar-compiled":  # the compiled storage also where the default call keeps the eager one
        return OscarCache(model, method="hadamard", group_size=64, compile=True)
    if method.startswith("oscar-skip"):  # oscar-skipN: the first N layers kept in full precision (skip_layers)
        return OscarCache(model, method="hadamard", group_size=64, skip_layers=tuple(range(int(method[10:]))))
    if method.startswith("oscar-fp"):  # oscar-fpN: N retrieval heads (INT8, as the library stores them), spread out
        n = int(method.removeprefix("oscar-fp").removesuffix("-serial").removesuffix("-apart"))  # (suffixes: run_one)
        cfg = model.config.get_text_config(decoder=True)
        nl, hk = cfg.num_hidden_layers, cfg.num_key_value_heads
        return OscarCache(model, method="hadamard", group_size=64,
                          retrieval_heads=tuple(((j * nl) // n, j % hk) for j in range(n)))
    if method == "oscar-static":
        return StaticOscarCache(model, method="hadamard", group_size=64, max_cache_len=capacity)
    raise ValueError(method)


def run_one(model, method: str, batch: int, context: int, new_tokens: int, device, seed=0, fill=False):
    try:
        return _run_one(model, method, batch, context, new_tokens, device, seed, fill)
    finally:  # the model's attention back to its own implementation, also where the cache's build ran out of memory
        if method.startswith("bf16-strong"):
            from strong_bf16 import restore

            restore(model)


def _run_one(model, method: str, batch: int, context: int, new_tokens: int, device, seed, fill):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(100, model.config.vocab_size - 100, (batch, context + int(fill)), generator=g).to(device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    cache = make_cache(model, method, context + new_tokens + int(fill), explicit=fill)
    kwargs.update(cache_kwargs(model, cache) if cache is not None else dict(cache_implementation="static"))
    clock = StepClock()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    if fill:  # the cache holds `context` tokens; generate feeds the last prompt token, then decodes
        with torch.no_grad():
            synthetic_fill(model, cache, batch, context, device)
    t0 = time.perf_counter()
    # oscar-fpN-serial: the retrieval heads' read on the layer's stream, not beside it; -apart: their own combine;
    # -beside / -joined: the write split at every batch, its demotion beside the read / one write launch at every batch
    # (the default splits it at small batches; WRITE_DEFAULTS: absent from older trees, compare_trees.py)
    heads, write = settings.HEADS_DEFAULTS, getattr(settings, "WRITE_DEFAULTS", None)
    plain = method.removesuffix("-beside").removesuffix("-joined")
    settings.HEADS_DEFAULTS = dataclasses.replace(heads, side_stream=not plain.endswith("-serial"),
                                                  merged=not plain.endswith("-apart"))
    if write is not None and plain != method:
        settings.WRITE_DEFAULTS = dataclasses.replace(write, beside_max_batch=1 << 30 if method.endswith("-beside")
                                                      else 0)
    try:
        with torch.no_grad():
            out = model.generate(ids, logits_processor=LogitsProcessorList([clock]), return_dict_in_generate=True,
                                 **kwargs)
    finally:
        settings.HEADS_DEFAULTS = heads
        if write is not None:
            settings.WRITE_DEFAULTS = write
    st = clock.stamps
    # median step time: robust to the one-off Triton JIT compile of a new kernel specialization
    steps = sorted(b - a for a, b in zip(st, st[1:]))
    res = dict(method=method, batch=batch, context=context, new_tokens=new_tokens, synthetic_fill=fill,
               prefill_s=st[0] - t0, decode_ms_per_token=steps[len(steps) // 2] * 1000,
               decode_ms_mean=(st[-1] - st[0]) / (len(st) - 1) * 1000)
    res["tokens_per_s"] = batch * 1000 / res["decode_ms_per_token"]
    if device == "cuda":
        res["peak_mem_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    cache = cache if cache is not None else returned_cache(out)
    res["cache_bytes"] = cache_bytes(cache) if cache is not None else None
    if isinstance(cache, OscarCache):
        res["cache_allocated_bytes"] = int(cache.memory_report()["allocated"])
    res["first_tokens"] = out.sequences[0, ids.shape[1] : ids.shape[1] + 8].tolist()
    # generate compiles the decode step on CUDA only
    res["compiled"] = device == "cuda" and (method == "bf16-static" or bool(getattr(cache, "compiled", False))
                                            or method.startswith("bf16-strong"))
    if method.startswith("oscar"):
        from oscar_hf import disable_oscar

        disable_oscar(model)
    del out, kwargs, cache
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 100000])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--methods", nargs="+", default=["bf16", "oscar"])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--capacity-context", type=int, default=32768)
    p.add_argument("--kv-budget-gib", type=float, default=48.0)
    p.add_argument("--capacity-run", action="store_true", help="measure throughput at each method's largest batch")
    p.add_argument("--capacity-methods", nargs="+", default=None,
                   help="methods run at the largest batch (default bf16 oscar); a -static suffix runs the compiled "
                        "variant at the batch computed for its base method")
    p.add_argument("--synthetic-fill", action="store_true",
                   help="fill the caches with random K/V through their write path instead of a prefill "
                        "(decode-only measurements at batch x context whose prefill activations would not fit)")
    p.add_argument("--capacity-only", action="store_true", help="skip the sweep; capacity from --bytes-per-token")
    p.add_argument("--bytes-per-token", nargs=2, type=float, metavar=("BF16", "OSCAR"), default=None,
                   help="KV bytes allocated per token (all layers) by an earlier sweep; 0: this run's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtype = torch.bfloat16
    model = build_model(args.shape, dtype, args.device, max(args.contexts) + args.new_tokens + 16)
    if any(t in ("sliding_attention", "chunked_attention") for t in getattr(model.config, "layer_types", None) or ()):
        # Transformers' StaticSlidingWindowLayer (in StaticCache and in OscarCache(compile=True)) branches on a Python
        # int that grows every step (cumulative_length_int, Transformers 5.17): with automatic dynamic shapes off, every
        # decode step recompiled (33 recompiles in 7 minutes on the H200, Gemma-3-12B shape, both caches alike). On, as
        # for any user, the int turns symbolic after one recompile. Such shapes run one (batch, context) per process.
        torch._dynamo.config.automatic_dynamic_shapes = True
    results = []
    combos = [] if args.capacity_only else [(b, t, m) for t in args.contexts for b in args.batches for m in args.methods]
    for b, t, m in tqdm(combos, desc="bench"):
        try:
            r = run_one(model, m, b, t, args.new_tokens, args.device, fill=args.synthetic_fill)
        except Exception as e:  # out of memory, or a backend that is missing or fails: record it, measure the others
            oom = isinstance(e, torch.OutOfMemoryError)
            r = dict(method=m, batch=b, context=t, error="out of memory" if oom else f"{type(e).__name__}: {str(e)[:300]}")
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)
        results.append(r)
        save(args, argv, results, {})
    # ratios against the baselines, same (batch, context), same run: the strong BF16 (its fastest read in the run),
    # then Transformers' DynamicCache and compiled StaticCache
    for r in results:
        if "error" in r:
            continue
        same = [x for x in results if x["batch"] == r["batch"] and x["context"] == r["context"] and "error" not in x]
        strong = min((x for x in same if x["method"].startswith("bf16-strong")), default=None,
                     key=lambda x: x["decode_ms_per_token"])
        if strong and not r["method"].startswith("bf16-strong"):
            r["speedup_vs_bf16_strong"] = strong["decode_ms_per_token"] / r["decode_ms_per_token"]
            r["bf16_strong_read"] = strong["method"]
        for base in ("bf16", "bf16-static"):
            ref = next((x for x in same if x["method"] == base), None)
            if ref and r["method"] != base:
                r[f"speedup_vs_{base.replace('-', '_')}"] = ref["decode_ms_per_token"] / r["decode_ms_per_token"]
                if base == "bf16" and r.get("cache_bytes") and ref.get("cache_bytes"):
                    r["kv_bytes_ratio_vs_bf16"] = ref["cache_bytes"] / r["cache_bytes"]
    capacity = {}
    per_tok = {}
    for m in ("bf16", "oscar", "oscar-static"):  # (oscar-static: its capacity is the run's length, as BF16's static)
        if rs := [r for r in results if r["method"] == m and r.get("cache_bytes")]:
            big = max(rs, key=lambda r: r["batch"] * r["context"])
            n = big["batch"] * (big["context"] + big["new_tokens"] - 1)
            per_tok[m] = (big.get("cache_allocated_bytes") or big["cache_bytes"]) / n
    if args.bytes_per_token:  # (a 0: the bytes this run allocated)
        per_tok.update({m: b for m, b in zip(("bf16", "oscar"), args.bytes_per_token) if b})
    budget = args.kv_budget_gib * 2**30
    for m, bpt in per_tok.items():
        capacity[m] = dict(bytes_per_token=bpt, max_tokens=int(budget / bpt),
                           max_batch_at_context=int(budget / (bpt * (args.capacity_context + args.new_tokens))))
    if args.capacity_run and capacity:
        for m in args.capacity_methods or list(capacity):
            # each method at the batch of its bytes per token (its own where measured, else its family's)
            base = m if m in per_tok else "bf16" if m.startswith("bf16") else "oscar"
            if base not in capacity:
                continue
            c = capacity.setdefault(m, dict(capacity[base]))
            b = max(1, c["max_batch_at_context"])
            try:  # (a row of the sweep above at that batch and context serves as it is)
                r = next((x for x in results if (x["method"], x["batch"], x["context"]) == (m, b, args.capacity_context)
                          and "error" not in x), None) or run_one(model, m, b, args.capacity_context, args.new_tokens,
                                                                   args.device, fill=args.synthetic_fill)
                c.update(batch=b, aggregate_tokens_per_s=r["tokens_per_s"], peak_mem_gib=r.get("peak_mem_gib"),
                         decode_ms_per_token=r["decode_ms_per_token"], cache_bytes=r.get("cache_bytes"),
                         cache_allocated_bytes=r.get("cache_allocated_bytes"))
            except torch.OutOfMemoryError:
                c.update(batch=b, error="out of memory")
                gc.collect()
                torch.cuda.empty_cache()
            print(json.dumps({m: c}), flush=True)
            save(args, argv, results, capacity)
        # aggregate decode tokens/s at equal KV memory, against the strong BF16 at its largest batch
        strong = capacity.get("bf16-strong", {}).get("aggregate_tokens_per_s")
        for m, c in capacity.items():
            if strong and c.get("aggregate_tokens_per_s") and m != "bf16-strong":
                c["aggregate_vs_bf16_strong"] = c["aggregate_tokens_per_s"] / strong
    return save(args, argv, results, capacity)


def run_env(argv, **extra) -> dict:
    """Where a benchmark ran (versions, GPU) and the command that reproduces it; every benchmark's ``env``."""
    import transformers

    return dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                command="python " + " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])), **extra)


def write_json(path, doc: dict, indent: int = 2) -> None:
    """``doc`` to ``path`` (folders made) when a path is given; benchmarks call it after every measurement."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=indent))


def save(args, argv, results, capacity) -> dict:
    """The run's document; written to ``--out`` after every measurement, so a run cut short keeps its rows."""
    shape = dict(SHAPES[args.shape], name=args.shape)
    shape.setdefault("attn_implementation", "sdpa")
    doc = dict(env=run_env(argv), shape=shape, results=results, capacity=capacity,
               kv_budget_gib=args.kv_budget_gib, capacity_context=args.capacity_context)
    write_json(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
