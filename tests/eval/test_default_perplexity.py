"""The defaults' perplexity CLI with a long exact prompt (``--prefill``): only the tokens after it are scored, each a
decode step that reads the prompt's rows from the INT2 history; a prompt as long as the window is refused."""
import pytest
import torch

from oscar_hf.eval import default_perplexity

from test_perplexity import random_artifact
from tiny_models import tiny_model


@pytest.fixture
def setup(tmp_path, monkeypatch):
    m = tiny_model("llama", head_dim=64, initializer_range=0.2)  # sharp attention: a quantized history shows
    random_artifact(m).save_pretrained(tmp_path / "art")
    monkeypatch.setattr(default_perplexity, "load_ids",
                        lambda tok, text, n: torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(3)))
    run = lambda *extra: default_perplexity.main(  # noqa: E731
        ["--artifact", str(tmp_path / "art"), "--texts", "wikitext", "--context", "400", "--windows", "1",
         "--dtype", "float32", "--out", str(tmp_path), "--name", "ppl", *extra], model=m, tokenizer=object())
    return run


def test_prefill_scores_the_tokens_after_it(setup):
    res = setup("--prefill", "360")
    rows = [r["wikitext"] for r in res["rows"].values()]
    assert res["setup"]["prefill_len"] == 360
    assert [r["tokens"] for r in rows] == [40, 40] and all(r["path"] == "token-by-token" for r in rows)
    # past sink 64 + recent 256 the prompt's rows are INT2 from the first scored step on: OSCAR is not BF16
    assert abs(rows[1]["nll"] - rows[0]["nll"]) > 1e-4
    one = [r["wikitext"] for r in setup()["rows"].values()]
    assert [r["tokens"] for r in one] == [399, 399]


def test_prefill_as_long_as_the_window_is_refused(setup):
    with pytest.raises(ValueError, match="context_len=400 must lie in"):
        setup("--prefill", "400")


def test_reference_path_fast_gives_the_decoded_numbers(setup):
    """--reference-path fast scores the full-precision row in one forward: its numbers are DynamicCache decoding's,
    and the OSCAR row stays token by token."""
    exact = setup("--prefill", "360")["rows"]
    fast = setup("--prefill", "360", "--reference-path", "fast")
    ref, osc = (r["wikitext"] for r in fast["rows"].values())
    assert (ref["path"], osc["path"]) == ("fast", "token-by-token") and fast["setup"]["reference_path"] == "fast"
    exact_ref, exact_osc = (r["wikitext"] for r in exact.values())
    assert ref["nll"] == pytest.approx(exact_ref["nll"], rel=1e-5) and osc["nll"] == exact_osc["nll"]


def test_row_adds_the_artifact_with_other_windows(setup):
    """--row scores the artifact with other settings beside its defaults; every OSCAR row carries the budget measure
    (OscarConfig.stored_bits at the pricing context: the window here, the artifact having no chosen settings)."""
    res = setup("--prefill", "360", "--row", "sink=32,recent=128,group_size=32")
    ref, default, wide = (r["wikitext"] for r in res["rows"].values())
    assert list(res["rows"])[2] == "artifact, sink 32, recent 128, group_size 32"
    assert wide["settings"]["sink"] == 32 and wide["settings"]["recent"] == 128 and wide["settings"]["group_size"] == 32
    assert wide["nll"] != default["nll"] and "budget_bits" not in ref
    # 400 cached tokens: 160 window tokens at 16 bits, 240 INT2 at group 32 (2 + 32/32 bits), no retrieval head
    assert wide["budget_bits"] == {"context": 400, "bits": pytest.approx((160 * 16 + 240 * 3.0) / 400)}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        setup("--row", "window=4")


def test_row_settings_parse_each_key_and_refuse_others():
    assert default_perplexity.row_settings("retrieval_bits=4,sink=128,quantizer=std") == dict(
        retrieval_bits=4, sink=128, quantizer="std")
    with pytest.raises(ValueError, match="entries are KEY=VALUE"):
        default_perplexity.row_settings("retrieval_width=4")
    with pytest.raises(ValueError, match="entries are KEY=VALUE"):
        default_perplexity.row_settings("sink=")
