#!/usr/bin/env python
"""Does a change of the compiled storage change its arithmetic? Two source trees' greedy scores, bit for bit.

    python benchmarks/compare_scores.py --old /tmp/old_site --new /tmp/oscar_site \
        --out benchmarks/results/scores_vs_<rev>_cpu.json

Each tree (a folder laid out as the package installs, as ``compare_trees.py`` takes them) runs in a process of its
own: ``OscarCache(model, compile=True)`` through ``generate``'s compiled route on the CPU (dynamo with the eager
backend: the decode step's ops as they are traced, no code generator),
greedy, on a tiny random Qwen3 in bfloat16, without and with retrieval heads. The report says per case whether the
tokens and the per-step scores are identical and the largest score difference. Identical scores mean the change kept
the arithmetic (the references' order of operations); on a GPU, tokens of random weights can still differ, since
Inductor's fusions and the kernels' summation order round differently (compiled BF16 ``StaticCache`` and eager
``DynamicCache`` differ from the 4th token at B=1/1K, docs/results.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {"int2": {}, "retrieval heads": dict(full_precision_heads=((0, 1), (1, 0)))}
SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens


def scores_of_this_tree(out: str, prompt: int, new_tokens: int) -> None:
    """In the tree on ``sys.path``: each case's tokens and scores -> ``out`` (safetensors)."""
    import torch
    from safetensors.torch import save_file

    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs
    from oscar_hf.models import tiny_model
    from transformers import CompileConfig

    # generate's compile route on the CPU (oscar_hf.compiled_step.cpu_compile_config, written here again so that
    # trees older than it run too)
    cc = CompileConfig(fullgraph=True, backend="eager", mode=None)
    cc._compile_all_devices = True

    torch.manual_seed(0)
    m = tiny_model("qwen3", dtype=torch.bfloat16)
    ids = torch.randint(3, m.config.vocab_size - 3, (1, prompt))
    tensors = {}
    for name, extra in CASES.items():
        torch._dynamo.reset()
        g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                       compile_config=cc,
                       **cache_kwargs(m, OscarCache(m, compile=True, **SMALL, **extra)))
        tensors[f"{name}/tokens"] = g.sequences[0, prompt:].contiguous()
        tensors[f"{name}/scores"] = torch.stack(g.scores).float().contiguous()  # [new_tokens, 1, vocab]
    save_file(tensors, out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--old-name", default="old")
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--out", required=True)
    p.add_argument("--_one", help=argparse.SUPPRESS)  # (the child process: its output file)
    a = p.parse_args(argv)
    if a._one:
        return scores_of_this_tree(a._one, a.prompt, a.new_tokens)
    from safetensors.torch import load_file

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tree, site in (("old", a.old), ("new", a.new)):
            f = str(Path(tmp) / f"{tree}.safetensors")
            subprocess.run([sys.executable, "-P", __file__, "--old", a.old, "--new", a.new, "--prompt", str(a.prompt),
                            "--new-tokens", str(a.new_tokens), "--out", a.out, "--_one", f],
                           env=dict(os.environ, PYTHONPATH=site), check=True, cwd=tmp)
            runs[tree] = load_file(f)
    old, new = runs["old"], runs["new"]
    cases = {}
    for name in CASES:
        so, sn = old[f"{name}/scores"], new[f"{name}/scores"]
        cases[name] = dict(same_tokens=bool(old[f"{name}/tokens"].equal(new[f"{name}/tokens"])),
                           same_scores=bool(so.equal(sn)), max_abs_score_diff=float((so - sn).abs().max()),
                           max_abs_score=float(so.abs().max()), tokens=new[f"{name}/tokens"][:12].tolist())
        print(name, cases[name])
    report = dict(command="python compare_scores.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  old=a.old_name, new="this tree", prompt=a.prompt, new_tokens=a.new_tokens, cases=cases)
    Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
