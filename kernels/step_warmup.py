"""The compiled op's Triton kernels compiled in a helper process while torch compiles the step (CUDA only,
``OSCAR_WARM_KERNELS=1``, off by default): layouts (:func:`spec_of`), the helper (:func:`serve`, zeros from
:func:`values_of`), closing its input (:func:`release`). Design and why it is off: docs/kernels.md §3.7.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

class _Helper:
    """This process's helper (at most one at a time) and the argument sets already handed to one."""

    proc: subprocess.Popen | None = None
    done: set[str] = set()


# ---------------------------------------------------------------- the description of one call's arguments

def spec_of(args: tuple) -> dict | None:
    """An op's positional ``args`` (real or fake tensors) as JSON-able data (a tensor's layout, dtype and device);
    None when a size is symbolic (nothing concrete to compile for)."""
    items = []
    for a in args:
        if a is None:
            items.append(None)
        elif isinstance(a, torch.Tensor):
            meta = (tuple(a.shape), a.stride(), a.storage_offset())
            if not all(isinstance(x, int) for part in meta[:2] for x in part) or not isinstance(meta[2], int):
                return None
            items.append(dict(shape=list(meta[0]), stride=list(meta[1]), offset=meta[2],
                              dtype=str(a.dtype).removeprefix("torch."), device=str(a.device)))
        elif isinstance(a, torch.dtype):
            items.append(dict(dtype_arg=str(a).removeprefix("torch.")))
        elif isinstance(a, (bool, int, float, str)):
            items.append(dict(value=a))
        else:
            return None
    return dict(args=items)


def values_of(spec: dict) -> list:
    """The values :func:`spec_of` described: zero tensors of the same strides and storage offset (a pointer's
    alignment and a stride's divisibility are part of a kernel's specialization)."""
    out = []
    for item in spec["args"]:
        if item is None:
            out.append(None)
        elif "shape" in item:
            shape, stride, offset = item["shape"], item["stride"], item["offset"]
            extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0)
            base = torch.zeros(extent if all(shape) else offset + 1, dtype=getattr(torch, item["dtype"]),
                               device=item["device"])
            out.append(base.as_strided(shape, stride, offset))
        elif "dtype_arg" in item:
            out.append(getattr(torch, item["dtype_arg"]))
        else:
            out.append(item["value"])
    return out


# ---------------------------------------------------------------- the parent's side

def note(args: tuple, entry: str) -> None:
    """Hand the op's arguments to a helper process, once per distinct set; ``entry``: ``"module:function"`` it runs."""
    on = os.environ.get("OSCAR_WARM_KERNELS", "0").lower() in ("1", "true", "yes", "on")
    spec = spec_of(args) if on and isinstance(args[0], torch.Tensor) and _on_cuda(args[0]) else None
    if spec is None:
        return
    line = json.dumps(spec, sort_keys=True)
    if line in _Helper.done:
        return
    _Helper.done.add(line)
    try:
        if _Helper.proc is None:
            _Helper.proc = _spawn(args[0].device, entry)
        _Helper.proc.stdin.write(line + "\n")
        _Helper.proc.stdin.flush()
    except OSError:  # (a helper that died: the step compiles the kernels itself)
        _Helper.proc = None


def _on_cuda(q: torch.Tensor) -> bool:
    return q.device.type == "cuda"


def release() -> subprocess.Popen | None:
    """From the op's first real call: no more arguments; the helper finishes the ones it has and exits (returned,
    not waited for)."""
    proc, _Helper.proc = _Helper.proc, None
    if proc is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    return proc


def _spawn(device: torch.device, entry: str) -> subprocess.Popen:
    # the ptxas version (part of Triton's cache key, cached per process) read now, so that Inductor's later change of
    # TRITON_PTXAS_PATH cannot give this process and the helper different keys for one kernel
    with contextlib.suppress(Exception):  # (another backend or Triton: a key that differs costs only the time saved)
        from triton.backends.nvidia.compiler import get_ptxas_version
        major, minor = torch.cuda.get_device_capability(device)
        get_ptxas_version(major * 10 + minor)  # (the argument Triton's CUDA backend passes: its target's arch)
    env = dict(os.environ)  # (TRITON_PTXAS_PATH as this process has it: the helper's kernels get the same keys)
    # the folder the step's first run will read: the user's, else the one Inductor sets before that run
    # (CachingAutotuner, torch 2.5-2.13)
    if "TRITON_CACHE_DIR" not in env:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
        env["TRITON_CACHE_DIR"] = triton_cache_dir(device.index or 0)
    # this process's imports, but not a checkout's root, whose `kernels/` would shadow the Hub's `kernels` package
    # that Transformers >= 5.25 imports (the editable install finds oscar_hf anyway)
    package = sys.modules[__name__.rsplit(".", 2)[0]]  # oscar_hf (loaded before any of its modules)
    path = [str(Path(package.__file__).resolve().parent.parent), *(p for p in sys.path if p)]
    path = [p for p in path if not (Path(p) / "kernels" / "step_warmup.py").is_file()]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    module, function = entry.split(":")
    return subprocess.Popen([sys.executable, "-P", "-c", f"from {module} import {function}; {function}()"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)


# ---------------------------------------------------------------- the helper process

def serve(run) -> int:
    """The helper's loop: ``run(spec)`` for each description on stdin, one a line, until it closes. A description it
    cannot run is one line on stderr (the step compiles those kernels itself)."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            run(json.loads(line))
        except Exception as e:  # noqa: BLE001
            print(f"oscar-hf: compiling the decode kernels ahead failed for one layout ({type(e).__name__}: {e}); "
                  "the step's first run compiles them instead", file=sys.stderr)
    return 0
