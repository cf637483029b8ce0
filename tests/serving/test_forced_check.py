"""The load test's teacher-forced token check (``forced_check.py``) on a tiny random Llama, CPU, float32, with each of
the load test's tokenizers (SmolLM2's and the character one): it follows a prompt's own greedy stream, flags a stream
with one token that was not its step's best (and passes it once the tolerance admits that token's gap), and flags a
stream checked against another prompt. With the character tokenizer (one token a character, the GPU run's) the tokens
it recovers from a stream's text are exactly the served ones, whichever they are."""
import functools
import random

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from forced_check import forced_check
from serve_load import load_tokenizer, make_prompts

OSCAR = dict(sink=4, recent=8, group_size=32)


@functools.cache  # (one per tokenizer, for the parametrized fixture and the character tokenizer's own test)
def build(tokenizer: str):
    """A tiny random Llama of ``tokenizer``'s vocabulary, 3 prompts and their greedy streams (10 tokens each)."""
    from transformers import AutoModelForCausalLM

    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs

    from tiny_models import tiny_config

    tok = load_tokenizer(tokenizer)
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


@pytest.fixture(scope="module", params=["smollm2", "chars"])
def setup(request):
    return build(request.param)


def test_a_prompts_own_stream_is_followed_and_another_prompts_is_flagged(setup):
    model, tok, prompts, streams = setup
    texts = [tok.decode(t, skip_special_tokens=True) for t, _ in streams]
    counts = [len(t) for t, _ in streams]
    own = forced_check(model, tok, prompts, texts, counts, OSCAR, tol=1e-3, batch=2)
    assert [g["verdict"] for g in own] == ["followed"] * 3 and all(g["recovered"] == 10 for g in own)
    assert [g["token_ids"] for g in own] == [t for t, _ in streams]  # (the best split: the greedy tokens)
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


class SecondBest(LogitsProcessor):
    """Forces each step's second-best token other than EOS: a stream that is not the greedy one (as a batched BF16
    step that rounds a near tie the other way serves)."""

    def __init__(self, eos: int):
        self.eos = eos

    def __call__(self, input_ids, scores):
        s = scores.clone()
        s[:, self.eos] = float("-inf")
        forced = torch.full_like(scores, float("-inf"))
        forced[torch.arange(len(s)), s.topk(2).indices[:, 1]] = 0.0
        return forced


def test_the_char_tokenizers_streams_are_recovered_exactly_whatever_their_tokens():
    from oscar_hf import OscarCache
    from oscar_hf.compat import cache_kwargs

    model, tok, prompts, _ = build("chars")
    ids = torch.tensor([tok(prompts[0]).input_ids])
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id,
                         logits_processor=LogitsProcessorList([SecondBest(tok.eos_token_id)]),
                         **cache_kwargs(model, OscarCache(model, method="hadamard", compile=False, **OSCAR)))
    served = out[0, ids.shape[1]:].tolist()
    text = tok.decode(served, skip_special_tokens=True)
    assert len(served) == len(text) == 12
    # a tolerance that admits any gap (the relative gap is at most 2): followed, and its tokens are the served ones
    loose, = forced_check(model, tok, prompts[:1], [text], [len(served)], OSCAR, tol=2.0)
    assert loose["verdict"] == "followed" and loose["token_ids"] == served and loose["max_gap"] > 0
    # a tolerance below their gaps: wrong at a step of the stream, still read as the served tokens (not lost)
    strict, = forced_check(model, tok, prompts[:1], [text], [len(served)], OSCAR, tol=loose["max_gap"] / 2)
    assert strict["verdict"] == "wrong" and strict["lost"] is None and strict["token_ids"] == served


def test_the_control_checks_each_stream_against_a_prompt_answered_otherwise():
    from serve_load import follow_diverged

    model, tok, prompts, streams = build("chars")
    # two prompts with one reference stream (here one prompt twice; a random model with a vocabulary of characters
    # answers many prompts "cccc..."): each stream is checked against the next prompt answered otherwise
    asked, refs = [prompts[0], prompts[0], prompts[1]], {0: streams[0], 1: streams[0], 2: streams[1]}
    refs = [{i: dict(tokens=t) for i, (t, _) in refs.items()}]
    control = follow_diverged([], (model,), asked, refs, tok, dict(tie_tol=0.0, oscar=OSCAR))
    assert control["ok"] and control["others_flagged"] == control["others"] == 3, control
    assert control["others_past_alike"] == 1  # (prompt 0 against prompt 2, past prompt 1)
    # where every prompt is answered alike, nothing can be flagged: the control fails
    alike = [{i: dict(tokens=streams[0][0]) for i in range(2)}]
    assert not follow_diverged([], (model,), asked[:2], alike, tok, dict(tie_tol=0.0, oscar=OSCAR))["ok"]


def test_the_char_tokenizer_takes_a_token_a_character_round_trips_and_streams_as_saved(tmp_path):
    from tokenizers.decoders import DecodeStream
    from transformers import AutoProcessor, AutoTokenizer

    from serve_load import CHARS, is_char_tokenizer, oversized_prompt, to_alphabet

    tok = load_tokenizer("chars")
    # every character, and what BPE splits or Transformers' clean-up joins: spaces before punctuation, runs of spaces,
    # a word's halves, the special token's ASCII look-alike
    text = CHARS + " it 's  here . co vered covered\n\n  <eos> </s> ~"
    tok.save_pretrained(tmp_path)  # (as serve_load saves it beside each model, which the server loads by path)
    for t in (tok, AutoTokenizer.from_pretrained(tmp_path), AutoProcessor.from_pretrained(tmp_path)):
        ids = t(text).input_ids
        assert ids == tok(text).input_ids and len(ids) == len(text) and t.eos_token_id not in ids
        assert t.decode(ids, skip_special_tokens=True) == text  # (the server's non-streamed answer)
        assert t.decode(ids + [t.eos_token_id], skip_special_tokens=True) == text
        # one character an id: every id but EOS decodes to a character of its own
        assert sorted(t.decode([i]) for i in range(len(t)) if i != t.eos_token_id) == sorted(CHARS)
        assert len(t) == len(CHARS) + 1 and t.pad_token_id == t.eos_token_id
        assert t.unk_token_id is None and t.bos_token_id is None  # (no id that decodes to nothing but EOS)
        # as Transformers' serving streams an answer: the Rust tokenizer's DecodeStream, special tokens skipped
        stream = DecodeStream(skip_special_tokens=True)
        pieces = [stream.step(t._tokenizer, i) for i in ids + [t.eos_token_id]]
        assert pieces == list(text) + [None]
        assert is_char_tokenizer(t)
    # the prompts: the test's words in the alphabet, as many tokens as drawn (a token a character)
    assert to_alphabet(tok, "a\tb \u00e9\r\nc") == "a b  \nc" and to_alphabet(tok, text) == text
    prompts = make_prompts(tok, random.Random(0), 8, 20, 60)
    assert all(20 <= len(tok(x).input_ids) == len(x) <= 60 and set(x) <= set(CHARS) for x in prompts)
    assert len(tok(oversized_prompt(tok, 1000)).input_ids) == 1001


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
