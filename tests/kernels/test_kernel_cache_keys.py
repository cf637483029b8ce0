"""The kernels' keys in Triton's on-disk cache do not depend on what a process launched first."""
from __future__ import annotations

import json
import subprocess
import sys

_KEYS = """
import importlib, json, os
from triton.runtime.jit import JITFunction
first = {first!r}
if first:  # a process that launched the prefill's write kernel before the decode step's
    importlib.import_module("oscar_hf.kernels.write_triton")._rotate_quantize_kernel.cache_key
mods = [importlib.import_module("oscar_hf.kernels." + m) for m in {mods!r}]
fns = {{f"{{m.__name__}}.{{k}}": v for m in mods for k, v in vars(m).items() if isinstance(v, JITFunction)}}
settled = all(f.hash is not None for f in fns.values())
print(json.dumps(dict(settled=settled, keys={{k: f.cache_key for k, f in fns.items()}})))
"""


def test_kernel_cache_keys_do_not_depend_on_what_a_process_launched_first():
    """Two processes find each other's kernels in the on-disk cache: every jit function's key is computed at its
    module's import (plan.settle_cache_keys), so a kernel's key (Triton 3.6 folds its helpers' constexpr globals in
    only if their keys exist) is the same whether the process has launched another kernel sharing those helpers
    first (generate's prefill) or not."""
    mods = ["write_triton", "append_triton", "query_triton", "decode_split", "decode_combine", "heads_triton"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}  # (compiled kernels' keys)
    runs = [json.loads(subprocess.run([sys.executable, "-P", "-c", _KEYS.format(first=first, mods=mods)], env=env,
                                      capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            for first in (False, True)]
    assert runs[0]["settled"] and runs[1]["settled"]
    assert len(runs[0]["keys"]) >= 10 and runs[0]["keys"] == runs[1]["keys"]
