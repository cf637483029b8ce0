"""The common ways people call a model, each with an OscarCache on SmolLM2-135M (real weights, float32 CPU):
the text-generation pipeline, ``model(**inputs, cache=...)`` forward loops (scoring in chunks), and a
chat-template conversation continued over several turns on one cache.

Settings: sink 4 + recent 16, so that prompts of a few dozen tokens already keep most of their context in the
INT2 history (the default sink 64 + recent 256 would leave these short prompts in full precision).
"""
import contextlib
import copy
import warnings

import pytest
import torch
from transformers import DynamicCache, pipeline

from oscar_hf import OscarCache
from oscar_hf.cache import OscarLayer
from oscar_hf.compat import cache_kwargs, returned_cache

pytestmark = pytest.mark.slow  # loads the real SmolLM2 weights

SMALL = dict(method="hadamard", sink=4, recent=16)  # quantizes once a sequence passes 20 tokens
WHOLE = dict(method="hadamard", sink=4, recent=4096)  # nothing quantized: must equal DynamicCache bit for bit
PROMPT = ("The history of the city of Paris begins with a small settlement on an island in the Seine, where a "
          "Celtic tribe called the Parisii")


def history_rows(cache) -> list[int]:
    """INT2 history entries per quantized layer."""
    return [layer.export_state()["hist_k"].codes.shape[2] for layer in cache.layers if isinstance(layer, OscarLayer)]


@contextlib.contextmanager
def no_deprecation():
    """Turn the deprecation of the cache argument's old name into an error (5.24 warns for ``past_key_values=``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        yield


# ---------------------------------------------------------------------------------------------- pipeline
def test_pipeline_hands_the_cache_to_generate(smollm2):
    """``pipe(prompt, cache=...)`` (a generate kwarg passed straight to the call; the text-generation pipeline of 5.17
    and 5.24 forwards unknown kwargs to ``generate``, while ``generate_kwargs={...}`` reaches ``generate`` as an
    unknown model kwarg and is refused): the same text as ``model.generate`` with a fresh equal cache, and the
    pipeline's cache ends holding that run's INT2 history."""
    model, tok = smollm2
    side = tok.padding_side
    pipe = pipeline("text-generation", model=model, tokenizer=tok)  # (sets the shared tokenizer to left padding)
    cache = OscarCache(model, **SMALL)
    try:
        with no_deprecation():
            got = pipe(PROMPT, max_new_tokens=12, do_sample=False, return_full_text=False, **cache_kwargs(model, cache))
    finally:
        tok.padding_side = side
    text = got[0]["generated_text"]

    inputs = tok(PROMPT, return_tensors="pt", add_special_tokens=False)  # how the pipeline encodes a string prompt
    n = inputs["input_ids"].shape[1]
    assert n > SMALL["sink"] + SMALL["recent"]
    direct = OscarCache(model, **SMALL)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False, **cache_kwargs(model, direct))
    assert text == tok.decode(out[0, n:], skip_special_tokens=True)
    assert text.strip()
    # the pipeline's generate filled *our* cache (not one of its own): prompt + 11 fed tokens, INT2 history in use
    assert cache.get_seq_length() == direct.get_seq_length() == out.shape[1] - 1
    assert history_rows(cache) == history_rows(direct) and min(history_rows(cache)) > 0
    for a, b in zip(cache.layers, direct.layers):
        if isinstance(a, OscarLayer):
            assert torch.equal(a.export_state()["hist_k"].codes, b.export_state()["hist_k"].codes)


# ---------------------------------------------------------------------------------------------- forward loops
@torch.no_grad()
def run_forward(model, ids, cache, schedule, with_mask: bool, start: int = 0):
    """Feed ``ids [1, N]`` through ``cache`` in chunks of the given sizes (``model(chunk, cache=..., use_cache=True)``
    as a scoring loop does); returns the logits ``[N - start, V]``. ``with_mask``: pass a 2D attention mask of ones over
    every slot so far (what ``generate`` passes); without it the model builds a causal mask from the cache length.
    ``start``: tokens the cache already holds (``ids[:, :start]``)."""
    logits, t = [], start
    for size in schedule:
        chunk = ids[:, t : t + size]
        extra = dict(attention_mask=torch.ones(1, t + size, dtype=torch.long)) if with_mask else {}
        out = model(chunk, use_cache=True, **extra, **cache_kwargs(model, cache))
        assert returned_cache(out) is cache
        t += size
        assert cache.get_seq_length() == t, f"after {t} tokens the cache says {cache.get_seq_length()}"
        logits.append(out.logits[0])
    return torch.cat(logits)


def test_forward_loop_scoring_in_chunks(smollm2, wikitext_text):
    """Scoring a text by feeding it through one cache in chunks (a 30-token prefill, a 10-token chunk, then one token
    per call), with and without a 2D attention mask, against one-token calls and the no-cache forward.

    Quantized runs are exactly comparable only where every earlier token went through the same reads: a token's
    keys/values at layer 2 and up depend on what its own attention read (full precision inside a chunk, INT2 history
    in a one-token call), so a chunked cache and a one-token cache legitimately hold different history. Checked:
    * the prefill's logits = the no-cache forward's (the prompt is attended in full precision), and so are the
      one-token run's first sink + recent positions (nothing quantized yet);
    * the same schedule with and without the mask gives the same logits;
    * from one cache state (a copy after the prefill), a 10-token chunk's first token = a one-token call
      (the multi-token read of sink + INT2 history + recent = the decode read);
    * nothing quantized (recent 4096): chunks = one-token calls = the no-cache forward.
    Both quantized runs really read the INT2 history (off the full-precision logits) and stay close to them."""
    model, tok = smollm2
    ids = tok(wikitext_text[5000:7000], return_tensors="pt").input_ids[:, :72]
    n, w = ids.shape[1], SMALL["sink"] + SMALL["recent"]
    chunks = [30, 10] + [1] * (n - 40)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits[0]  # [72, V], full precision
    chunked = run_forward(model, ids, OscarCache(model, **SMALL), chunks, with_mask=True)
    torch.testing.assert_close(run_forward(model, ids, OscarCache(model, **SMALL), chunks, with_mask=False), chunked,
                               atol=1e-4, rtol=1e-4)
    steps_cache = OscarCache(model, **SMALL)
    steps = run_forward(model, ids, steps_cache, [1] * n, with_mask=False)
    assert min(history_rows(steps_cache)) == n - w
    torch.testing.assert_close(chunked[:30], ref[:30], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(steps[:w], ref[:w], atol=2e-4, rtol=1e-4)

    prefilled = OscarCache(model, **SMALL)
    run_forward(model, ids[:, :30], prefilled, [30], with_mask=False)
    assert min(history_rows(prefilled)) == 30 - w
    twin = copy.deepcopy(prefilled)
    as_chunk = run_forward(model, ids[:, :40], prefilled, [10], with_mask=False, start=30)
    as_step = run_forward(model, ids[:, :31], twin, [1], with_mask=False, start=30)
    torch.testing.assert_close(as_chunk[:1], as_step, atol=1e-4, rtol=1e-4)

    exact = [run_forward(model, ids, OscarCache(model, **WHOLE), s, with_mask=False) for s in (chunks, [1] * n)]
    for logits in exact:
        torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)

    for logits in (chunked, steps):
        assert (logits[w:] - ref[w:]).abs().amax() > 1e-2  # the INT2 history is read
        nll = lambda lg: torch.nn.functional.cross_entropy(lg[w:-1], ids[0, w + 1 :]).item()  # noqa: E731
        assert nll(ref) < nll(logits) < 1.25 * nll(ref), (nll(ref), nll(logits))


def test_forward_loop_equals_generate(smollm2):
    """A hand-written greedy loop (prefill, then ``model(next_token, cache=...)``) reproduces ``generate``'s logits
    step for step on a prompt past sink + recent, and the cache length advances one per call."""
    model, tok = smollm2
    inputs = tok(PROMPT, return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    with no_deprecation():
        gen = model.generate(**inputs, max_new_tokens=10, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **cache_kwargs(model, OscarCache(model, **SMALL)))
    new = gen.sequences[:, n:]
    cache = OscarCache(model, **SMALL)
    logits = run_forward(model, gen.sequences[:, :-1], cache, [n] + [1] * (new.shape[1] - 1), with_mask=True)
    mine = logits[n - 1 :]  # the logits that predicted each new token
    torch.testing.assert_close(mine, torch.cat(gen.logits), atol=1e-4, rtol=1e-4)
    assert torch.equal(mine.argmax(-1), new[0])
    assert min(history_rows(cache)) > 0


# ---------------------------------------------------------------------------------------------- chat turns
TURNS = ["Name three rivers in Europe and say one thing about each.", "Which of them is the longest?",
         "Write one sentence about its source."]


def chat(model, tok, cache, new_tokens=24, **gen_kw):
    """Run ``TURNS`` as a conversation on one cache: each turn re-encodes the whole conversation with the chat
    template and calls ``generate`` with the same cache (which feeds only the tokens the cache does not hold yet).
    Returns per turn ``(prompt_ids, generate_output)``."""
    messages, turns, held = [], [], None
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = inputs["input_ids"]
        if held is not None:
            # Transformers does not check what the cache holds: the template must reproduce the cached tokens
            # (the previous prompt and reply, its last token excepted) as a prefix of the new prompt.
            n = cache.get_seq_length()
            assert n == held.shape[1] - 1 and torch.equal(ids[:, :n], held[:, :n])
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                             **gen_kw, **cache_kwargs(model, cache))
        held = out.sequences
        assert cache.get_seq_length() == held.shape[1] - 1
        reply = tok.decode(held[0, ids.shape[1] :], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        turns.append((ids, out))
    return turns


def test_chat_turns_continue_on_one_cache(smollm2):
    """A three-turn chat-template conversation on one OscarCache. Exactly comparable, and checked:
    * nothing quantized (recent larger than the conversation): every turn's tokens equal a DynamicCache reused the
      same way (the cached prefix is not re-fed; positions continue), and the last turn equals the whole
      conversation run from scratch in a fresh DynamicCache;
    * quantized (sink 4 + recent 16, most of the conversation in INT2): a fresh cache fed the same tokens by hand
      in the same order (each turn's new prompt tokens as one chunk, then each reply token) gives the logits
      ``generate`` saw at every step, and the cache length is the conversation's.
    Not exactly comparable, so not compared: the quantized conversation against a from-scratch run. From scratch the
    whole last prompt is prefilled in full precision, while on the reused cache each turn's prompt reads the earlier
    turns from the INT2 history (and their keys/values deeper in the model were computed from such reads). With
    recent 16 the next-token KL between the two is ~0.6-0.8 nats on this model, and a bound on it does not
    separate a correct reuse from a broken one (losing the whole earlier context scores ~0.45, re-feeding the
    cached prefix ~1.0): the replay above is the check that can fail."""
    model, tok = smollm2
    dyn = chat(model, tok, DynamicCache(config=model.config))
    whole = chat(model, tok, OscarCache(model, **WHOLE))
    for (ids_d, out_d), (ids_w, out_w) in zip(dyn, whole):
        assert torch.equal(ids_d, ids_w) and torch.equal(out_d.sequences, out_w.sequences)
    ids, out = whole[-1]
    n_new = out.sequences.shape[1] - ids.shape[1]
    scratch = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                             **cache_kwargs(model, DynamicCache(config=model.config)))
    assert torch.equal(scratch, out.sequences)

    cache = OscarCache(model, **SMALL)
    with no_deprecation():
        turns = chat(model, tok, cache, output_logits=True)
    final = turns[-1][1].sequences
    assert cache.get_seq_length() == final.shape[1] - 1
    assert min(history_rows(cache)) == cache.get_seq_length() - SMALL["recent"] - SMALL["sink"]

    # replay: the same token stream, fed by hand through a fresh cache in generate's order
    schedule, want, t = [], [], 0
    for ids, out in turns:
        new = out.sequences.shape[1] - ids.shape[1]
        schedule += [ids.shape[1] - t] + [1] * (new - 1)
        want += list(out.logits)
        t = out.sequences.shape[1] - 1
    replay = run_forward(model, final[:, :-1], OscarCache(model, **SMALL), schedule, with_mask=True)
    ends = torch.tensor(schedule).cumsum(0) - 1  # each call's last position: the logits generate chose from
    torch.testing.assert_close(replay[ends], torch.cat(want), atol=1e-4, rtol=1e-4)
