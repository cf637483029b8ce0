"""The compiled step's host side (:mod:`oscar_hf.compiled_step`): a one-token step whose every layer is a compiled
OSCAR layer gets no 4D mask from ``generate`` (nothing reads it), with the same tokens; any other step, or a cache with
another kind of layer, still gets Transformers' mask."""
import torch

from oscar_hf import OscarCache
from oscar_hf import compiled_step as step_mod
from oscar_hf.compat import cache_kwargs

from batch_utils import cpu_compile_config, random_left_padded
from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)


def _masks(m, cache, ids, am, length):
    """What ``generate``'s mask hook gives a step of ``length`` tokens."""
    return m.create_masks_for_generate(config=m.config, inputs_embeds=torch.empty(ids.shape[0], length, 0),
                                       attention_mask=am, **cache_kwargs(m, cache),
                                       position_ids=torch.zeros(ids.shape[0], length, dtype=torch.long))


def test_one_token_steps_build_no_mask_and_give_the_same_tokens(monkeypatch):
    m = tiny_model("llama")
    ids, am = random_left_padded([5, 19, 26])
    cache = OscarCache(m, compile=True, **SMALL)
    calls = []
    unread = step_mod._mask_unread
    monkeypatch.setattr("oscar_hf.compiled_step._mask_unread", lambda *a: calls.append(unread(*a)) or calls[-1])
    gen = dict(attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = m.generate(ids, compile_config=cpu_compile_config(), **gen, **cache_kwargs(m, cache))
    ref = m.generate(ids, **gen, **cache_kwargs(m, OscarCache(m, **SMALL)))  # the eager storage
    assert torch.equal(out, ref)
    assert calls[0] is False and len(calls) == 12 and all(calls[1:]), "the prefill keeps it, every decode step skips it"
    full = torch.ones(ids.shape[0], ids.shape[1] + 12, dtype=torch.long)
    assert _masks(m, cache, ids, full, 1) is None
    assert _masks(m, cache, ids, full, 2) is not None  # a multi-token step keeps it
    eager = OscarCache(m, **SMALL)  # the eager storage reads the mask (left padding)
    m.generate(ids, **gen, **cache_kwargs(m, eager))
    assert not step_mod._mask_unread(eager, torch.empty(3, 1, 0))


def test_a_cache_with_another_layer_kind_keeps_the_mask():
    from transformers import StaticSlidingWindowLayer

    from oscar_hf.compiled_step import _mask_unread

    m = tiny_model("gemma3_text")
    ids, am = random_left_padded([9, 30])
    cache = OscarCache(m, compile=True, **SMALL)
    assert any(isinstance(x, StaticSlidingWindowLayer) for x in cache.layers)
    m.generate(ids, attention_mask=am, max_new_tokens=3, do_sample=False, pad_token_id=0,
               compile_config=cpu_compile_config(), **cache_kwargs(m, cache))
    assert not _mask_unread(cache, torch.empty(2, 1, 0))
