"""The load test's teacher-forced token check (``forced_check.py``) on a tiny random Llama, CPU, float32: it follows a
prompt's own greedy stream, flags a stream with one token that was not its step's best (and passes it once the
tolerance admits that token's gap), and flags a stream checked against another prompt."""
import random

import pytest
import torch

from forced_check import forced_check
from serve_load import load_tokenizer, make_prompts

OSCAR = dict(sink=4, recent=8, group_size=32)


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM

    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs

    from tiny_models import tiny_config

    tok = load_tokenizer(None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok)), dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
    prompts = make_prompts(tok, random.Random(0), 3, 20, 60)
    streams = []
    for text in prompts:  # (greedy, 10 tokens, with each step's logits)
        ids = torch.tensor([tok(text).input_ids])
        out = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tok.eos_token_id,
                             **cache_kwargs(model, OscarCache(model, method="hadamard", compile=False, **OSCAR)))
        streams.append((out.sequences[0, ids.shape[1]:].tolist(), [x[0].float() for x in out.logits]))
    return model, tok, prompts, streams


def test_a_prompts_own_stream_is_followed_and_another_prompts_is_flagged(setup):
    model, tok, prompts, streams = setup
    texts = [tok.decode(t, skip_special_tokens=True) for t, _ in streams]
    counts = [len(t) for t, _ in streams]
    own = forced_check(model, tok, prompts, texts, counts, OSCAR, tol=1e-3, batch=2)
    assert [g["verdict"] for g in own] == ["followed"] * 3 and all(g["recovered"] == 10 for g in own)
    assert max(g["max_gap"] for g in own) < 1e-4
    other = forced_check(model, tok, prompts[1:] + prompts[:1], texts, counts, OSCAR, tol=1e-3)
    assert [g["verdict"] for g in other] == ["wrong"] * 3
    # each flagged stream's distance from its step's best (at least the 16th token's gap where it was lost) is far
    # above the own streams' largest gap: the margin a tolerance has
    assert all((g["gap"] if g["gap"] is not None else g["lost_gap"]) > 10 * max(h["max_gap"] for h in own) + 1e-3
               for g in other)


def test_a_token_off_its_steps_best_is_flagged_at_that_step(setup):
    model, tok, prompts, streams = setup
    tokens, logits = streams[0]
    k = 3
    order = logits[k].topk(16).indices.tolist()
    # a lower-ranked token at step k whose text no better-ranked token's text starts (so it is recovered as itself)
    alt = next(c for c in order[2:] if c != tok.eos_token_id and all(
        not tok.decode(tokens[:k] + [c], skip_special_tokens=True).startswith(
            tok.decode(tokens[:k] + [b], skip_special_tokens=True)) for b in order[: order.index(c)]))
    text = tok.decode(tokens[:k] + [alt], skip_special_tokens=True)
    s = logits[k]
    gap = float((s.max() - s[alt]) / s.abs().max())
    strict, = forced_check(model, tok, prompts[:1], [text], [k + 1], OSCAR, tol=gap / 2)
    assert strict["verdict"] == "wrong" and strict["step"] == k and strict["gap"] == pytest.approx(gap, rel=1e-4)
    loose, = forced_check(model, tok, prompts[:1], [text], [k + 1], OSCAR, tol=gap * 2)
    assert loose["verdict"] == "followed" and loose["recovered"] == k + 1


def test_a_near_tied_longer_split_of_the_text_is_tried_when_the_best_split_fails():
    from forced_check import FollowText

    tok = load_tokenizer(None)
    # two tokens, one whose text starts the other's: "Arch" and "Architect" (or whatever pair the vocabulary has)
    short, long_ = next((tok.convert_tokens_to_ids(a), tok.convert_tokens_to_ids(a + b))
                        for a, b in (("Arch", "itect"), ("Ġinter", "national"), ("Ġcon", "tinue"))
                        if tok.convert_tokens_to_ids(a + b) != tok.unk_token_id)
    text = tok.decode([long_], skip_special_tokens=True)
    assert text.startswith(tok.decode([short], skip_special_tokens=True)) and short != long_
    logits = torch.zeros(len(tok))
    logits[short], logits[long_] = 10.0, 9.9  # (the longer split 1% below the best)
    best = FollowText(tok, [text], [1])
    assert best._pick(0, logits) == short
    assert FollowText(tok, [text], [1], longest_within=0.02)._pick(0, logits) == long_
    assert FollowText(tok, [text], [1], longest_within=0.005)._pick(0, logits) == short  # (outside the tolerance)


def test_a_request_skipped_by_the_deadline_fails_the_run_instead_of_crashing_its_summary():
    from serve_load import summarize

    done = dict(kind="oversized", status=400, detail="needs more INT2 pages than the pool has")
    skipped = [dict(kind=k, model=0, prompt=0, verdict="not_run") for k in ("oversized", "malformed", "duplicate")]
    _, checks = summarize([done] + skipped, tie_tol=0.01)
    assert not checks["every_request_answered"]["ok"] and len(checks["every_request_answered"]["failed"]) == 3
    assert checks["refusals"]["ok"]  # (judged on the requests that ran)
    _, checks = summarize([dict(done, status=500)], tie_tol=0.01)
    assert not checks["refusals"]["ok"]
