"""Needle generator places the needle where asked; the scorer tells right from wrong answers."""
import pytest
import torch

from oscar_hf.eval.methods import get_method
from oscar_hf.eval.haystack import filler_ids
from oscar_hf.eval.needle import NEEDLE, answer, make_needle_prompt, score_answer

from tiny_models import tiny_model


class CharTok:
    """A tokenizer stand-in: one token per character (so positions are easy to check)."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 251 + 1 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("length", [300, 1000])
def test_needle_at_requested_depth(depth, length):
    tok = CharTok()
    hay = torch.full((2000,), 7)
    ctx, q, at = make_needle_prompt(tok, hay, length, depth, "quiet-river", "1234567")
    assert len(ctx) + len(q) == length
    needle = torch.tensor(tok(" " + NEEDLE.format(key="quiet-river", value="1234567") + " ")["input_ids"])
    n_hay = len(ctx) - len(needle)
    assert torch.equal(ctx[at : at + len(needle)], needle)  # the needle is really there
    assert abs(at / n_hay - depth) <= 1 / n_hay  # at the requested relative depth of the haystack
    assert (ctx[:at] == 7).all() and (ctx[at + len(needle) :] == 7).all()


def test_needle_rejects_bad_arguments():
    tok = CharTok()
    with pytest.raises(ValueError):
        make_needle_prompt(tok, torch.zeros(100, dtype=torch.long), 1000, 0.5, "k", "1")
    with pytest.raises(ValueError):
        make_needle_prompt(tok, torch.zeros(5000, dtype=torch.long), 1000, 1.5, "k", "1")


@pytest.mark.parametrize("text,ok", [
    (" 4817263.", True), ("4817263", True), (" 4,817,263 is the number", True),
    (" 4817264.", False), (" 48172630", False), (" 481726", False), (" none", False), ("", False),
    (" 12 and then 4817263", False),
])
def test_scorer(text, ok):
    assert score_answer(text, "4817263") is ok


def test_answer_runs_through_cache():
    model = tiny_model("llama")
    tok = CharTok()
    hay = filler_ids(tok, 400) % 250
    ctx, q, _ = make_needle_prompt(tok, hay, 200, 0.5, "k", "42")
    a = answer(model, tok, ctx % 250, q % 250, lambda: get_method("hadamard", sink=4, recent=16, group_size=32).make_cache(model), 5)
    b = answer(model, tok, ctx % 250, q % 250, lambda: get_method("fp").make_cache(model), 5)
    assert isinstance(a, str) and isinstance(b, str) and len(b) <= 5


def test_run_grid_shares_cells_and_resumes():
    from oscar_hf.eval.needle import GridOptions, accuracy_table, length_summary, run_grid
    from oscar_hf.eval.needle_cli import markdown_table

    model = tiny_model("llama")
    tok = CharTok()
    hay = filler_ids(tok, 400) % 250
    tok_mod = lambda x: x % 250  # noqa: E731
    methods = {"fp": get_method("fp"), "int2": get_method("identity", sink=4, recent=16, group_size=32)}

    class ModTok(CharTok):
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [tok_mod(i) for i in super().__call__(text)["input_ids"]]}

    opts = GridOptions(trials=2, progress=False)
    res = run_grid(model, ModTok(), hay, methods, [240, 280], [0.0, 1.0], opts)
    raw = res["answers"]
    assert len(raw) == 2 * 2 * 2 * 2
    for m in methods:  # every method saw exactly the same needles
        assert sorted((r["length"], r["depth"], r["value"]) for r in raw if r["method"] == "fp") == \
            sorted((r["length"], r["depth"], r["value"]) for r in raw if r["method"] == m)
    assert set(res["accuracy"]) == set(methods) and set(res["accuracy"]["fp"]) == {"240", "280"}

    class Boom:  # a resumed run must not answer any cell again
        def make_cache(self, model):
            raise AssertionError("cell re-run")

    again = run_grid(model, ModTok(), hay, {"fp": Boom(), "int2": Boom()}, [240, 280], [0.0, 1.0], opts, done=raw)
    assert again["answers"] == raw
    # one length of the grid: its cells are the full grid's (resumed: nothing re-run), the other length's dropped
    only = GridOptions(trials=2, progress=False, run_lengths=(280,))
    part = run_grid(model, ModTok(), hay, {"fp": Boom(), "int2": Boom()}, [240, 280], [0.0, 1.0], only, done=raw)
    assert part["answers"] == [r for r in raw if r["length"] == 280] and len(part["answers"]) == 8
    with pytest.raises(ValueError, match="run_lengths"):  # a length outside the grid would run nothing
        run_grid(model, ModTok(), hay, methods, [240, 280], [0.0, 1.0], GridOptions(run_lengths=(256,)))
    with pytest.raises(ValueError, match="score"):  # a misspelt option stops at the options, not mid-grid
        GridOptions(score="nl")
    with pytest.raises(ValueError, match="hay_stride"):
        GridOptions(hay_stride=-1)

    fake = [dict(method="a", length=1, depth=0.0, correct=True), dict(method="a", length=1, depth=0.5, correct=False),
            dict(method="b", length=1, depth=0.0, correct=True), dict(method="b", length=1, depth=0.5, correct=True)]
    acc = accuracy_table(fake)
    assert acc == {"a": {"1": {"0.0": 1.0, "0.5": 0.0}}, "b": {"1": {"0.0": 1.0, "0.5": 1.0}}}
    s = length_summary(acc, "b")
    assert s["a"]["1"] == {"accuracy": 0.5, "ratio_to_reference": 0.5}
    md = markdown_table({"accuracy": accuracy_table(fake[2:] + fake[:2]), "answers": fake[2:] + fake[:2]})
    assert "| a | 1 | 100% (1) | 0% (1) | 50% | 0.50 |" in md and "| b | 1 | 100% (1) | 100% (1) | 100% | 1.00 |" in md


def test_answer_nll_equals_one_forward_for_full_precision_cache():
    """Teacher-forced answer NLL through a DynamicCache = the NLL of the answer tokens in one forward
    over context + question + answer; an INT2 cache reads a different (noisier) history."""
    from oscar_hf.eval.needle import answer_nll

    model = tiny_model("llama")
    tok = CharTok()
    hay = filler_ids(tok, 400) % 250
    ctx, q, _ = make_needle_prompt(tok, hay, 200, 0.5, "k", "42")
    ctx, q = ctx % 250, q % 250
    nll, n = answer_nll(model, tok, ctx, q, "42", lambda: get_method("fp").make_cache(model))
    target = torch.tensor(tok(" 42")["input_ids"])
    assert n == len(target) == 3
    with torch.no_grad():
        logits = model(torch.cat([ctx, q, target])[None]).logits[0].float()
    lp = torch.log_softmax(logits[len(ctx) + len(q) - 1 : -1], -1)
    ref = -lp[torch.arange(n), target].sum().item()
    assert abs(nll - ref) < 1e-4 * max(1.0, abs(ref))
    nll_q, _ = answer_nll(model, tok, ctx, q, "42",
                          lambda: get_method("identity", sink=4, recent=16, group_size=32).make_cache(model))
    assert nll_q != nll


@pytest.mark.parametrize("method", ["fp", "hadamard"])
def test_fast_answer_scores_equal_token_by_token(method):  # fp: DynamicCache; hadamard: OscarCache
    """One exact prefill + one fake-quantized forward of question + answer gives the answer NLL that
    feeding the question and answer token by token through the real cache gives (OscarCache for INT2),
    including the decode-time window shift (the needle sits in the INT2 history)."""
    from oscar_hf.eval.needle import answer_nll, fast_answer_scores

    model = tiny_model("llama")
    tok = CharTok()
    hay = filler_ids(tok, 400) % 250
    ctx, q, at = make_needle_prompt(tok, hay, 240, 0.5, "k", "42")
    ctx, q = ctx % 250, q % 250
    m = get_method(method) if method == "fp" else get_method(method, sink=4, recent=16, group_size=32)
    assert 4 < at < len(ctx) - 16  # the needle is history, not window
    nll, n = answer_nll(model, tok, ctx, q, "42", lambda: m.make_cache(model))
    other = get_method("identity", sink=4, recent=16, group_size=32).fake_spec(model)
    fast = fast_answer_scores(model, tok, ctx, q, "42", {"m": m.fake_spec(model), "other": other})
    assert fast["m"]["n_answer_tokens"] == n
    assert abs(fast["m"]["nll"] - nll) < 2e-4 * max(1.0, abs(nll))
    assert abs(fast["other"]["nll"] - nll) > 1e-3  # a different method scores differently


class BosCharTok(CharTok):
    """CharTok that starts every text with a BOS token unless told not to, as Gemma's tokenizer does."""

    bos_token_id = 2

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [2] * add_special_tokens + super().__call__(text)["input_ids"]}


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_prompt_starts_with_the_tokenizers_bos(depth):
    tok = BosCharTok()
    hay = torch.full((2000,), 7)
    ctx, q, at = make_needle_prompt(tok, hay, 500, depth, "quiet-river", "1234567")
    assert len(ctx) + len(q) == 500 and ctx[0] == 2 and (ctx[1:] != 2).all() and (q != 2).all()
    needle = torch.tensor(tok(" " + NEEDLE.format(key="quiet-river", value="1234567") + " ", False)["input_ids"])
    assert torch.equal(ctx[at : at + len(needle)], needle) and at >= 1
    # without BOS the same prompt is the haystack alone
    plain = make_needle_prompt(CharTok(), hay, 500, depth, "quiet-river", "1234567")[0]
    assert len(plain) == len(ctx) and plain[0] != 2


def test_fast_answer_scores_read_a_sliding_window_model_from_the_same_prefix():
    """Gemma 3's sliding-window layers cannot be cropped back to the prefix: each method reads its own copy of the
    exact prefill, so the BF16 row scored after another method still equals token-by-token decoding."""
    from oscar_hf.eval.needle import answer_nll, fast_answer_scores

    model = tiny_model("gemma3_text", sliding_window=32)
    assert "sliding_attention" in model.config.layer_types
    tok = CharTok()
    hay = filler_ids(tok, 400) % 250
    ctx, q, _ = make_needle_prompt(tok, hay, 240, 0.5, "k", "42")
    ctx, q = ctx % 250, q % 250
    other = get_method("identity", sink=4, recent=16, group_size=32).fake_spec(model)
    fast = fast_answer_scores(model, tok, ctx, q, "42", {"other": other, "fp": None})
    nll, n = answer_nll(model, tok, ctx, q, "42", lambda: get_method("fp").make_cache(model))
    assert fast["fp"]["n_answer_tokens"] == n
    assert abs(fast["fp"]["nll"] - nll) < 2e-4 * max(1.0, abs(nll))
    assert abs(fast["other"]["nll"] - nll) > 1e-3
