"""Needle generator places the needle where asked; the scorer tells right from wrong answers."""
import pytest
import torch

from oscar_hf.eval.methods import get_method
from oscar_hf.eval.needle import NEEDLE, answer, filler_ids, make_needle_prompt, score_answer
from oscar_hf.models import tiny_model


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
