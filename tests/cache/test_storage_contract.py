"""One contract for every storage of the OSCAR KV, run on each:

* ``eager``: :class:`~oscar_hf.cache.layer.OscarLayer` with every forward eager (``OscarCache(compile=False)``);
* ``compiled``: the same layer under ``OscarCache(compile=True)``, its decode step
  through ``generate``'s compiled route (fullgraph; the CPU runs its torch reference), capacity buckets of 16 slots
  so that a generation grows the history (INT2 and coded rows) several times;
* ``paged``: :class:`~oscar_hf.serving.store.OscarPagedStore` under ``model.generate_batch`` (continuous
  batching: requests of different lengths share forwards, no padding).

What each must give: the greedy tokens and (close) log-probabilities of the eager layer run on each prompt alone, for
prefill + decode and chunked prefill, with retrieval heads stored at INT8 / 16 / INT4 bits (and a layer of INT8
heads only); and, where the storage has them (``generate``'s cache operations, which the paged store has not:
requests come and go whole), crop undoing decoded tokens exactly, beam search's reorder and batch select / repeat
following rows exactly, save / load continuing exactly in either generate storage.
"""
import inspect

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

from oscar_hf import OscarCache
from oscar_hf.cache import layer as compiled_mod
from oscar_hf.compat import cache_kwargs
from oscar_hf.serving import continuous_batching_config, paged_oscar

from batch_utils import cpu_compile_config, left_pad
from tiny_models import tiny_model

OSCAR = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes after 12 tokens
NEW = 16  # tokens generated
# tiny Llama: 2 layers x 2 KV heads of 32
HEADS = {
    "none": {},
    "int8": dict(retrieval_heads=((0, 1), (1, 0))),
    "int16": dict(retrieval_heads=((0, 1), (1, 0)), retrieval_bits=16),
    "int4": dict(retrieval_heads=((0, 1), (1, 0)), retrieval_bits=4),
    "int8-layer": dict(retrieval_heads=((1, 0), (1, 1))),  # layer 1 keeps no INT2 head
}
PAGED_HAS_NO = pytest.mark.skip(reason="the paged store serves continuous batching: a request comes and goes whole, "
                                       "no crop / beam reorder / batch select / save (generate's cache operations)")
STORAGES = ["eager", "compiled", "paged"]
CACHE_STORAGES = ["eager", "compiled", pytest.param("paged", marks=PAGED_HAS_NO)]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    """Capacity buckets of 16 slots: the compiled storage grows during a generation."""
    monkeypatch.setattr(compiled_mod, "BUCKET", 16)
    monkeypatch.setattr(compiled_mod, "HEADROOM", 0.0)


def prompts_of(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 200, (n,), generator=g).tolist() for n in lens]


def chosen_logprobs(scores, tokens, row):
    """``[n]``: the log-probability of each generated token of ``row`` (``scores``: generate's, one per step)."""
    return torch.stack([torch.log_softmax(s[row].float(), -1)[t] for s, t in zip(scores, tokens)])


def generate(storage, model, prompts, heads, chunk=None):
    """``[(tokens, logprobs)]`` per prompt: greedy through ``storage`` (a left-padded batch for the generate
    caches; requests of a batch-serving loop for the paged store, in chunks of ``chunk`` tokens if given)."""
    kw = dict(OSCAR, **HEADS[heads])
    if storage == "paged":
        cb = continuous_batching_config(num_blocks=128, max_batch_tokens=chunk or 256, page_size=8,
                                        max_requests_per_batch=1 if chunk else 3, return_logprobs=True)
        gen_cfg = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        chunks = []
        with paged_oscar(model, **kw) as store:
            attend = store.attend
            store.attend = lambda layer, q, k, v, batch, *a: chunks.extend(b for b in batch if b[2] > 1 and b[1] > 0) \
                or attend(layer, q, k, v, batch, *a)
            out = model.generate_batch(prompts, gen_cfg, continuous_batching_config=cb, warmup=False)
            assert store.pool.num_used == 0 and not store.requests and store.pool.peak_used > 0
        assert bool(chunks) == bool(chunk)  # prompts continued in chunks exactly when asked
        done = sorted(out.values(), key=lambda r: int(r.request_id.rsplit("_", 1)[-1]))  # req_<i>: prompt i
        return [(r.generated_tokens, torch.tensor(r.logprobs)) for r in done]
    ids, am = left_pad([torch.tensor(p) for p in prompts])
    cache = OscarCache(model, compile=storage == "compiled", **kw)
    extra = {}
    if storage == "compiled":  # (a clean dynamo cache: earlier tests' graphs count toward its recompile limit)
        torch._dynamo.reset()
        extra = dict(compile_config=cpu_compile_config())
    out = model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0, prefill_chunk_size=chunk, output_scores=True, return_dict_in_generate=True,
                         **cache_kwargs(model, cache), **extra)
    tokens = out.sequences[:, ids.shape[1]:]
    return [(tokens[i].tolist(), chosen_logprobs(out.scores, tokens[i], i)) for i in range(len(prompts))]


_REFERENCE: dict = {}


def reference(model, prompts, heads, chunk=None):
    """The eager layer on each prompt alone (computed once per case)."""
    key = (tuple(map(tuple, prompts)), heads, chunk)
    if key not in _REFERENCE:
        _REFERENCE[key] = [generate("eager", model, [p], heads, chunk)[0] for p in prompts]
    return _REFERENCE[key]


def assert_same(got, want):
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(logprobs, ref_logprobs, atol=5e-4, rtol=1e-4)


# ------------------------------------------------------------------ what every storage does
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("storage", STORAGES)
def test_prefill_and_decode(model, storage, heads):
    """Prompts before, inside and past sink + recent, decoded past their history's first pages / buckets."""
    prompts = prompts_of([3, 40, 17, 25])
    assert_same(generate(storage, model, prompts, heads), reference(model, prompts, heads))


@pytest.mark.skipif("prefill_chunk_size" not in inspect.signature(CompileConfig).parameters
                    and not hasattr(GenerationConfig(), "prefill_chunk_size"),
                    reason="generate has no prefill_chunk_size")
@pytest.mark.parametrize("heads", ["none", "int8"])
@pytest.mark.parametrize("storage", STORAGES)
def test_chunked_prefill(model, storage, heads):
    """Prompts sent 16 tokens at a time. ``generate(prefill_chunk_size=16)`` (eager, compiled): the later chunks read
    the earlier ones from the history (INT2 and coded rows), the memory the user chose chunks for. The paged store:
    the scheduler chunks, not the user, so a prompt's later chunks attend exactly to its earlier ones and the tokens
    are those of the prompt in one piece, whatever the chunking. Prompts of one length, so that a batch's chunks fall
    where each prompt's alone do."""
    prompts = prompts_of([45, 45], seed=1)
    want = reference(model, prompts, heads, chunk=None if storage == "paged" else 16)
    assert_same(generate(storage, model, prompts, heads, chunk=16), want)


# ------------------------------------------------------------------ generate's cache operations
def forward(model, cache, ids, am):
    with torch.no_grad():
        return model(ids, attention_mask=am, **cache_kwargs(model, cache)).logits


def filled(model, storage, heads, ids, am, steps: int):
    """A cache of ``storage`` after the prompt ``ids`` and ``steps`` decode steps (tokens 1, 2, ...); its mask."""
    cache = OscarCache(model, compile=storage == "compiled", **OSCAR, **HEADS[heads])
    forward(model, cache, ids, am)
    for j in range(steps):
        am = torch.cat([am, torch.ones(am.shape[0], 1, dtype=am.dtype)], 1)
        forward(model, cache, torch.full((ids.shape[0], 1), 1 + j), am)
    return cache, am


def next_logits(model, cache, am, n=1):
    am = torch.cat([am, torch.ones(am.shape[0], n, dtype=am.dtype)], 1)
    return forward(model, cache, torch.arange(7, 7 + n).repeat(am.shape[0], 1), am)


@pytest.mark.parametrize("heads", ["none", "int8"])
@pytest.mark.parametrize("storage", CACHE_STORAGES)
def test_crop_undoes_decoded_tokens_exactly(model, storage, heads):
    ids, am = left_pad([torch.tensor(p) for p in prompts_of([30, 22], seed=2)])
    cropped, _ = filled(model, storage, heads, ids, am, steps=10)
    cropped.crop(-10)
    assert cropped.get_seq_length() == ids.shape[1]
    fresh, _ = filled(model, storage, heads, ids, am, steps=0)
    torch.testing.assert_close(next_logits(model, cropped, am), next_logits(model, fresh, am))


@pytest.mark.parametrize("heads", ["none", "int8"])
@pytest.mark.parametrize("storage", CACHE_STORAGES)
def test_beam_search_reorders_rows(model, storage, heads):
    """reorder_cache: the cache of rows ``[2, 0, 0]`` is the one those rows build; beam search gives the reference's
    beams."""
    ids, am = left_pad([torch.tensor(p) for p in prompts_of([26, 30, 19], seed=3)])
    idx = torch.tensor([2, 0, 0])
    cache, am_after = filled(model, storage, heads, ids, am, steps=4)
    cache.reorder_cache(idx)
    want, _ = filled(model, storage, heads, ids[idx], am[idx], steps=4)
    torch.testing.assert_close(next_logits(model, cache, am_after[idx]), next_logits(model, want, am_after[idx]),
                               atol=1e-5, rtol=1e-5)
    prompt = torch.tensor([prompts_of([30], seed=4)[0]])
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, do_sample=False, pad_token_id=0)
    out = model.generate(prompt, **cache_kwargs(model, OscarCache(model, compile=storage == "compiled", **OSCAR,
                                                                  **HEADS[heads])), **beams)
    ref = model.generate(prompt, **cache_kwargs(model, OscarCache(model, compile=False, **OSCAR, **HEADS[heads])),
                         **beams)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("heads", ["none", "int8"])
@pytest.mark.parametrize("storage", CACHE_STORAGES)
def test_batch_repeat_and_select_follow_rows(model, storage, heads):
    ids, am = left_pad([torch.tensor(p) for p in prompts_of([25, 18], seed=5)])
    cache, am_after = filled(model, storage, heads, ids, am, steps=3)
    cache.batch_repeat_interleave(2)  # rows a a b b
    cache.batch_select_indices(torch.tensor([3, 0]))  # rows b a
    idx = torch.tensor([1, 0])
    want, _ = filled(model, storage, heads, ids[idx], am[idx], steps=3)
    torch.testing.assert_close(next_logits(model, cache, am_after[idx]), next_logits(model, want, am_after[idx]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", ["none", "int8"])
@pytest.mark.parametrize("storage", CACHE_STORAGES)
def test_save_load_continues_exactly_in_either_storage(model, storage, heads, tmp_path):
    """The saved form is one: a cache saved mid-generation continues a next turn alike, loaded eager or compiled."""
    ids, am = left_pad([torch.tensor(p) for p in prompts_of([25, 14], seed=6)])
    cache, am_after = filled(model, storage, heads, ids, am, steps=5)
    cache.save(tmp_path / "c")
    loaded = [OscarCache.load(tmp_path / "c", model, compile=c) for c in (False, True)]
    assert [c.compiled for c in loaded] == [False, True]
    want = next_logits(model, cache, am_after, n=3)
    for c in loaded:
        torch.testing.assert_close(next_logits(model, c, am_after, n=3), want, atol=2e-4, rtol=1e-4)


def test_a_real_text_scores_as_the_fake_quantized_forward(smollm2):
    """SmolLM2 with its shipped artifact (its 7 INT8 retrieval heads, sink 64 / recent 256), a held-out WikiText
    window: 768 tokens prefilled, 128 scored token by token, each step demoting a row to INT2. Every token's NLL
    through the cache (``compile=False``, and ``compile=True``'s storage run eagerly: no torch.compile on this path)
    is within 1e-3 of the fake-quantized forward's, an independent computation (one forward, every demoted row
    quantized in place), and the two caches' perplexities agree to 1e-6."""
    from importlib.resources import files

    from oscar_hf import OscarRotations
    from oscar_hf.eval.methods import get_method
    from oscar_hf.eval.perplexity import cache_nll, evaluation_ids, fast_nll

    model, tok = smollm2
    art = str(files("oscar_hf") / "pretrained" / "smollm2-135m-instruct")
    ids = evaluation_ids(tok, 768 + 128).reshape(1, -1)
    fake = fast_nll(model, ids, 768, get_method("oscar", rotations=OscarRotations.from_pretrained(art)).fake_spec(model),
                    return_token_nll=True)
    res = {c: cache_nll(model, ids, 768, lambda: OscarCache.from_pretrained(art, model, compile=c), progress=False,
                        return_token_nll=True) for c in (False, True)}
    diff = max(float((r["token_nll"] - fake["token_nll"]).abs().max()) for r in res.values())
    rel = abs(res[True]["ppl"] / res[False]["ppl"] - 1)
    print(f"perplexity fake-quantized {fake['ppl']:.6f}, cache {res[False]['ppl']:.6f} (compile=False) "
          f"{res[True]['ppl']:.6f} (compile=True), max token NLL difference to the fake-quantized {diff:.2g}")
    assert diff <= 1e-3 and rel <= 1e-6, (diff, rel, fake["ppl"], res[False]["ppl"], res[True]["ppl"])
