"""The user scripts (``scripts/*.py``, not a package) imported as modules, for in-process CLI tests, and the
multi-process checks (``tests/distributed/*.py``) that run under ``torchrun``."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BENCHMARKS = SCRIPTS.parent / "benchmarks"
DISTRIBUTED = Path(__file__).resolve().parent / "distributed"


def import_script(name: str):
    """``scripts/<name>.py`` as a module (its ``main(argv)`` is what the command line runs)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def import_benchmark(name: str):
    """``benchmarks/<name>.py`` loaded as a module (the benchmarks are not a package; loaded by path, so that no
    top-level name of theirs shadows another)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_for_test", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tiny(script, tmp_path, *extra) -> tuple[int, dict]:
    """A soak-style script's ``main`` in its tiny CPU mode: ``(exit status, the JSON it wrote)``."""
    import json

    out = tmp_path / "result.json"
    rc = script.main(["--tiny", "--device", "cpu", "--out", str(out), *extra])
    return rc, json.loads(out.read_text())


def run_under_torchrun(script: str, args: list[str], cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    """``tests/distributed/<script>`` with ``args`` under ``torchrun`` (2 ranks, gloo on the CPU, one thread each);
    skips where torch has no DTensor or no gloo."""
    pytest.importorskip("torch.distributed.tensor")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(DISTRIBUTED / script), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
