#!/usr/bin/env python
"""``transformers serve --continuous-batching`` with OSCAR's paged 2-bit KV cache: the same OpenAI-compatible server
(``/v1/completions``, ``/v1/chat/completions``, ...), every request's KV in OSCAR's store.

    python -P scripts/serve.py Qwen/Qwen3-8B --max-requests 64 -- --port 8000 --cb-num-blocks 4000
    python -P scripts/serve.py MODEL --rotations ./rotations-dir -- --device cuda:0

Options before ``--`` are OSCAR's (the rotations artifact or the artifact-free ``--method``, window slots, sink /
recent / group size, the prompt budget); everything after ``--`` goes to ``transformers serve`` unchanged
(``--cb-num-blocks`` counts INT2 pages of OSCAR's pool, ``--cb-max-memory-percent`` sizes it from free memory after
the window slots and the prompt budget). A model switch stops the old model's manager, which gives its store's memory
back. ``--continuous-batching`` and
``--attn-implementation sdpa`` are added. Needs ``pip install "transformers[serving]"``.

Before the port opens, the settings are checked against the model's config (a ``--rotations`` artifact made for
another model, a group size that does not divide its head_dim, ...): the script exits with the reason instead of
serving a worker that would fail at the first request. ``--rotations`` needs ``MODEL`` (an artifact fits one model).
When a model's manager starts, the read kernels' variants are compiled before it serves (``oscar_hf.serving.warmup``;
tens of seconds on a fresh machine, then Triton's disk cache), so that no served step waits for a compile
(``--no-warm-kernels`` skips it). The scheduler runs a joining request's prompt in a step of its own
(``--scheduler oscar_prefill_apart``, the default here; ``fifo`` is Transformers' default).
"""
from __future__ import annotations

import argparse
import sys


def parse(argv: list[str]):
    ours, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="model to preload (a Hub id or a local directory)")
    p.add_argument("--rotations", help="OSCAR rotations artifact (directory or Hub id); default: --method")
    p.add_argument("--method", default="hadamard", help="artifact-free rotation when no --rotations is given")
    p.add_argument("--max-requests", type=int, default=64,
                   help="requests live at once (a full-precision window slot each, allocated as requests come)")
    p.add_argument("--prompt-budget", type=int,
                   help="prompt tokens held in full precision at once while prompts arrive in chunks (default: the "
                        "model's max_position_embeddings); reserved when --cb-max-memory-percent sizes the pages")
    p.add_argument("--sink", type=int)
    p.add_argument("--recent", type=int)
    p.add_argument("--group-size", type=int)
    p.add_argument("--prefix-sharing", action="store_true",
                   help="a request whose prompt begins with INT2 pages a live request holds, or a finished one left "
                        "retained, starts on them (its prompt then reads the prefix from the INT2 pages: "
                        "docs/serving.md)")
    p.add_argument("--scheduler", default="oscar_prefill_apart",
                   choices=["oscar_prefill_apart", "fifo", "prefill_first"],
                   help="the continuous-batching scheduler (oscar_prefill_apart: a joining request's prompt runs in a "
                        "step of its own, so decode steps stay CUDA-graphed; Transformers' own: fifo, prefill_first)")
    p.add_argument("--no-warm-kernels", action="store_true",
                   help="skip compiling the read kernels' variants when a model's manager starts (on a fresh machine "
                        "they then compile inside the first steps that meet them, stalling those steps)")
    return p.parse_args(ours), theirs


def check_startup(model: str | None, rotations, max_requests: int, **overrides) -> None:
    """Build (and drop) the store the server would build for ``model``, from its config alone: whatever it refuses
    (an artifact that does not fit, settings the model cannot take) is raised here, before the port opens."""
    if model is None:
        if rotations is not None:
            raise SystemExit("--rotations fits one model: name it (python -P scripts/serve.py MODEL --rotations DIR)")
        return
    from transformers import AutoConfig

    from oscar_hf.serving import OscarPagedStore

    config = AutoConfig.from_pretrained(model)
    try:
        OscarPagedStore(config, rotations, max_requests=max_requests, defer_pool=True, **overrides)
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"OSCAR cannot serve {model} with these settings: {e}") from e


def main(argv: list[str] | None = None):
    args, theirs = parse(sys.argv[1:] if argv is None else argv)
    from oscar_hf import OscarRotations
    from oscar_hf.serving import oscar_serving
    from oscar_hf.serving.engine import log_to_stderr

    log_to_stderr()
    rotations = OscarRotations.from_pretrained(args.rotations) if args.rotations else None
    overrides = {k: v for k, v in dict(sink=args.sink, recent=args.recent, group_size=args.group_size,
                                       prompt_budget=args.prompt_budget).items() if v is not None}
    if args.prefix_sharing:
        overrides["prefix_sharing"] = True
    if not args.no_warm_kernels:
        overrides["warm_kernels"] = True
    if rotations is None:
        overrides["method"] = args.method
    check_startup(args.model, rotations, args.max_requests, **overrides)
    cli = ["serve", *([args.model] if args.model else []), "--continuous-batching", "--attn-implementation", "sdpa",
           *theirs]
    from transformers.cli.transformers import app

    with oscar_serving(rotations, scheduler_type=args.scheduler, max_requests=args.max_requests, **overrides):
        app(cli, standalone_mode=False)


if __name__ == "__main__":
    main()
