"""Retrieval heads in continuous batching: the paged store keeps the heads OscarCache keeps (an artifact's, by
default), so each request's greedy tokens equal its run alone through OscarCache with the same heads, and their
pages leave with the request. (Heads named explicitly, at 16 / 8 / 4 bits, in prompts sent whole or in chunks:
tests/cache/test_storage_contract.py, for every storage.)"""
import random

import pytest
import torch
from transformers import GenerationConfig

from oscar_hf import OscarCache, OscarRotations
from oscar_hf.compat import cache_kwargs
from oscar_hf.serving import continuous_batching_config, paged_oscar

OSCAR = dict(sink=4, recent=8, group_size=32)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def artifact(model):
    """Hadamard rotations with retrieval scores: the default ``retrieval_heads="auto"`` picks (0, 1) and (1, 0)
    (``max_history_bits=6`` pays for both at INT8)."""
    rot = OscarRotations.builtin(model.config, "hadamard")
    rot.retrieval_scores = torch.tensor([[0.1, 0.9], [0.6, 0.2]])
    return rot


def greedy_alone(model, prompt, cache):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0, **cache_kwargs(model, cache))
    return out[0, len(prompt):].tolist()


def serve(model, artifact, prompts, cb_cfg, bits, heads):
    """Greedy tokens of ``generate_batch`` through the paged store, the store, and the batches of layer 0."""
    gen_cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    batches = []
    with paged_oscar(model, rotations=artifact, retrieval_heads=heads, retrieval_bits=bits,
                     max_history_bits=6.0, **OSCAR) as store:
        attend = store.attend
        store.attend = lambda layer, q, k, v, batch, *a: (batches.append(batch) if layer == 0 else None) or attend(
            layer, q, k, v, batch, *a)
        out = model.generate_batch(prompts, gen_cfg, continuous_batching_config=cb_cfg, warmup=False)
        assert store.pool.num_used == 0 and not store.requests  # every request gave its pages (both forms) back
        assert store.pool.peak_used > 0 and store.pool.coded  # the coded rows did live in pages
    return [r.generated_tokens for r in out.values()], store, batches


def alone(model, artifact, prompts, bits, heads):
    return [greedy_alone(model, p, OscarCache(model, artifact, compile=False, retrieval_heads=heads,
                                              retrieval_bits=bits, max_history_bits=6.0, **OSCAR))
            for p in prompts]


def test_generate_batch_keeps_the_heads_of_oscar_cache(model, artifact):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (3, 40, 17, 25, 33)]
    cb_cfg = continuous_batching_config(num_blocks=128, max_batch_tokens=256, page_size=8, max_requests_per_batch=3)
    bits, heads = 8, "auto"
    got, store, batches = serve(model, artifact, prompts, cb_cfg, bits, heads)
    assert store.config.retrieval_heads == ((0, 1), (1, 0))  # the artifact's heads, named
    assert max(len(b) for b in batches) == 3  # decodes batched with other requests' rows
    assert got == alone(model, artifact, prompts, bits, heads)
    # the heads were in the loop: without them at least one request decodes differently
    assert got != alone(model, artifact, prompts, bits, 0)

