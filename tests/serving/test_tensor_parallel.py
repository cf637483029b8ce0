"""Serving under tensor parallelism: tests/distributed/tp_serving_check.py under torchrun with gloo on the CPU (2 ranks)."""
import json

from script_utils import run_under_torchrun


def test_generate_batch_under_tensor_parallelism(tmp_path):
    """Each rank's store holds its 2 of the 4 KV heads (the artifact's per-head rotations and offsets of exactly those
    heads; the retrieval head only on the rank that holds it, as a local id), generate_batch under tp_plan="auto"
    gives the single-process tokens exactly (float32), OSCAR is in the loop (BF16 serving differs), and the pool is
    empty afterwards."""
    out = tmp_path / "tp_serving.json"
    r = run_under_torchrun("tp_serving_check.py", ["--shape", "tiny", "--layers", "2", "--strict-tokens", "--out",
                                                   str(out)], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["world"] == 2 and res["tp_equals_single"] and res["oscar_differs_from_bf16"]
    for g in res["ranks"]:
        assert g["store_heads"] == 2 and g["query_heads"] == 4 and g["peak_pages"] > 0
        assert g["tp_layout"]["k"] == {"0": [2 * g["rank"], 2 * g["rank"] + 2], "1": [2 * g["rank"], 2 * g["rank"] + 2]}
        assert g["retrieval_heads"] == {"0": [1] if g["rank"] == 1 else [], "1": []}  # global head 3: rank 1's local 1
