"""README's main job, ``scripts/demo.py``, end to end on the packaged SmolLM2 with its shipped artifact (short
lengths; the model loaded once for the suite)."""
from __future__ import annotations

import json

import pytest
from script_utils import import_script


@pytest.mark.slow
def test_demo_uses_the_shipped_artifact_and_reports_both_caches(smollm2, monkeypatch, tmp_path, capsys):
    demo = import_script("demo")
    monkeypatch.setattr(demo, "load_model", lambda *a, **k: smollm2)
    monkeypatch.setattr(demo, "calibrate", lambda *a, **k: pytest.fail("the demo calibrated instead of using the "
                                                                        "shipped artifact"))
    out = tmp_path / "demo.json"
    ppl, mem = demo.main(["--new-tokens", "3", "--ppl-context", "384", "--ppl-tokens", "6",
                          "--artifacts", str(tmp_path / "none"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert "using the shipped artifact oscar_hf/pretrained/smollm2-135m-instruct" in printed
    assert set(ppl) == {demo.BASE, "OSCAR 2-bit"} and all(1 < p < 1e4 for p in ppl.values())
    # every cached element before the windows' 320 tokens is INT2 (+ bf16 metadata, INT8 heads): smaller than 16-bit
    assert mem["OSCAR 2-bit"] < mem[demo.BASE]
    assert json.loads(out.read_text())["kv_bytes"] == mem
