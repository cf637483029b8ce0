"""Serving under tensor parallelism: benchmarks/tp_serving_check.py under torchrun with gloo on the CPU (2 ranks)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_generate_batch_under_tensor_parallelism(tmp_path):
    """Each rank's store holds its 2 of the 4 KV heads (the artifact's per-head rotations and offsets of exactly those
    heads; the retrieval head only on the rank that holds it, as a local id), generate_batch under tp_plan="auto"
    gives the single-process tokens exactly (float32), OSCAR is in the loop (BF16 serving differs), and the pool is
    empty afterwards."""
    pytest.importorskip("torch.distributed.tensor")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path / "tp_serving.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "benchmarks/tp_serving_check.py"), "--shape", "tiny", "--layers", "2", "--strict-tokens",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["world"] == 2 and res["tp_equals_single"] and res["oscar_differs_from_bf16"]
    for g in res["ranks"]:
        assert g["store_heads"] == 2 and g["query_heads"] == 4 and g["peak_pages"] > 0
        assert g["tp_layout"]["k"] == {"0": [2 * g["rank"], 2 * g["rank"] + 2], "1": [2 * g["rank"], 2 * g["rank"] + 2]}
        assert g["retrieval_heads"] == {"0": [1] if g["rank"] == 1 else [], "1": []}  # global head 3: rank 1's local 1
