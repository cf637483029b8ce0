"""lm-eval adapter: BF16/FP settings equal lm-eval's stock `hf` model; OSCAR settings run and differ."""
import math
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from oscar_hf.eval.lm_eval_adapter import OscarLM  # noqa: E402

TASKS = Path(__file__).resolve().parents[2] / "eval" / "tasks"


def wordppl(lm, limit=1):
    tm = TaskManager(include_path=str(TASKS))
    res = lm_eval.simple_evaluate(model=lm, tasks=["wikitext_local"], limit=limit, task_manager=tm,
                                  bootstrap_iters=0, log_samples=False, metadata={"max_chars": 500})
    return res["results"]["wikitext_local"]["word_perplexity,none"], res


@pytest.mark.slow
def test_oscar_lm_matches_stock_hf_and_runs_quantized(smollm2):
    model, tok = smollm2
    kw = dict(tokenizer=tok, max_length=256, batch_size=1)
    stock, _ = wordppl(HFLM(pretrained=model, **kw))
    fp, _ = wordppl(OscarLM(pretrained=model, method="fp", **kw))
    assert math.isclose(stock, fp, rel_tol=1e-5), (stock, fp)
    q_lm = OscarLM(pretrained=model, method="identity", sink=4, recent=16, group_size=32, **kw)
    quant, res = wordppl(q_lm)
    assert math.isfinite(quant) and abs(quant / stock - 1) > 1e-3  # the cache is really in the loop
    info = q_lm.get_model_info()["oscar"]
    assert info["method"] == "identity" and info["sink"] == 4 and info["group_size"] == 32
    # prefill scoring through a fresh OscarCache is exact while nothing is quantized yet (T <= sink + recent)
    pre, _ = wordppl(OscarLM(pretrained=model, method="hadamard", sink=64, recent=256, score_mode="prefill", **kw))
    assert math.isclose(stock, pre, rel_tol=1e-5)


@pytest.mark.slow
def test_packaged_gemma3_by_name_matches_stock_hf():
    """``pretrained="gemma3-270m"``: the packaged Gemma with the tokenizer rebuilt from its GGUF (``<bos>`` first),
    scoring as lm-eval's stock ``hf`` model does on the same model and tokenizer."""
    from gemma3_helpers import gemma3_model

    model, tok = gemma3_model()
    kw = dict(max_length=256, batch_size=1)
    stock, _ = wordppl(HFLM(pretrained=model, tokenizer=tok, **kw))
    by_name = OscarLM(pretrained="gemma3-270m", method="fp", **kw)
    assert by_name.model.config.model_type == "gemma3_text" and by_name.tokenizer.bos_token == "<bos>"
    assert by_name.tok_encode("Hello")[0] == tok.bos_token_id
    fp, _ = wordppl(by_name)
    assert math.isclose(stock, fp, rel_tol=1e-5), (stock, fp)


def test_packaged_model_refuses_a_gguf_file():
    with pytest.raises(ValueError, match="packaged model"):
        OscarLM(pretrained="smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_task_loader_resolves_relative_to_its_file(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("wikitext_local", TASKS / "wikitext_local.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.chdir(tmp_path)  # a relative path must not depend on the working directory
    rel = Path("..") / ".." / "shared" / "data" / "wikitext-2-raw-test.txt"
    from oscar_hf.eval.models import wikitext_path

    if not (TASKS / rel).resolve().is_file():
        rel = Path(__import__("os").path.relpath(wikitext_path(), TASKS))
    ds = mod.load(path=str(rel), max_docs=3)
    assert len(ds["test"]) == 3 and all(d.lstrip().startswith("=") for d in ds["test"]["page"])
    full = wikitext_path().read_text(encoding="utf-8")
    assert full.find(ds["test"]["page"][0]) > len(full) // 2  # held-out half only
    with pytest.raises(OSError):
        mod.load(path="does/not/exist.txt")
