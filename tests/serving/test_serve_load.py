"""The load test of the real server (``serve_load.py``) at its CPU profile: ``scripts/serve.py`` as a process, a tiny
random Llama (and a tiny Qwen3 for the model switch), three dozen requests over HTTP from four threads; once with the
profile's tokenizer (SmolLM2's) and once with the character tokenizer, the GPU run's. The GPU run
(``benchmarks/run_gpu.sh serve-load``) is the same driver at the Qwen3-8B shape."""
import pytest

pytest.importorskip("fastapi", reason="transformers serve needs `pip install transformers[serving]`")
pytest.importorskip("uvicorn", reason="transformers serve needs `pip install transformers[serving]`")

from serve_load import KINDS, PROFILES, run  # noqa: E402  (tests/serving is on the path, as for graph_emulation)


@pytest.mark.parametrize("tokenizer", ["smollm2", "chars"])
def test_the_server_under_load_answers_every_request_exactly_and_holds_nothing_after(tmp_path, tokenizer):
    res = run("tiny", tmp_path, tokenizer)
    checks = res["checks"]
    assert res["settings"]["tokenizer"] == tokenizer and (res["vocab_size"] == 97) == (tokenizer == "chars")
    assert res["ok"], {k: c for k, c in checks.items() if not c["ok"]}
    # every kind of request was sent, in both load phases, and every well-formed one answered exactly
    assert {key.split(":")[0] for key in res["counts"]} == set(KINDS), res["counts"]
    assert res["wrong"] == 0 and res["followed"] == 0
    # the teacher-forced check (the GPU run's) follows each prompt's own stream and flags it against another prompt
    control = checks["forced_check_can_fail"]
    assert control["others_flagged"] == control["others"] >= 2 and control["own_max_gap"] <= control["tol"]
    answered = sum(n for key, n in res["counts"].items() if key.split(":")[0] in ("stream", "plain", "duplicate"))
    assert res["exact"] == answered == res["counts"]["stream:exact"] + res["counts"]["plain:exact"] + \
        res["counts"]["duplicate:exact"]
    assert res["counts"]["cancel:cancelled"] >= 2
    assert res["requests"] == PROFILES["tiny"]["requests"]
    # refusals, each with its reason
    examples = checks["refusals"]["examples"]
    assert "already live" in examples["duplicate"] and "INT2 pages" in examples["oversized"]
    assert checks["server_never_stopped"]["health"][0] == 200
    # three switches (A -> B -> A -> B) stop three managers, whose stores are released (5.25+: the two model
    # processes, stopped with the server, log theirs): none holds a request, page or window slot
    releases = checks["nothing_held"]["releases"]
    assert len(releases) >= checks["nothing_held"]["expected"] >= 2
    assert all(r["requests"] == r["pages_used"] == r["window_slots_used"] == 0 for r in releases)
    assert res["ttft_s"]["n"] > 0 and res["tokens_per_s"] > 0
