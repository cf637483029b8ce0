"""Whole tiny models on the shapes the kernels took on with head_dim 96 and soft-capping: Phi-3 (head_dim 96) and
Gemma 2 (``attn_logit_softcapping``, with a retrieval head) decoding through ``OscarCache`` with the Triton kernels
(the interpreter on the CPU) give the torch references' logits, and the kernels ran -- the write, the decode read and
the heads' read at the model's head_dim and cap (no silent fallback to the references)."""
from __future__ import annotations

import pytest
import torch
from kernel_utils import rel_err, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from oscar_hf import OscarCache  # noqa: E402
from oscar_hf.compat import cache_kwargs  # noqa: E402

from tiny_models import tiny_model  # noqa: E402

interp = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter tests (TRITON_INTERPRET=1 without CUDA)")


def _spy(monkeypatch, module, name, calls, what):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: (calls.append(what(*a, **kw)), real(*a, **kw))[1])


@interp
@pytest.mark.parametrize("name,model_kw,cache_kw,d,softcap", [
    ("phi3", {}, {}, 96, None),  # head_dim 96: G = 32 (groups across the 24-channel planes)
    ("gemma2", dict(head_dim=64, query_pre_attn_scalar=64, attn_logit_softcapping=5.0, initializer_range=0.2),
     dict(retrieval_heads=((1, 1),)), 64, 5.0),
])
def test_tiny_model_on_the_kernels(monkeypatch, name, model_kw, cache_kw, d, softcap):
    from oscar_hf.kernels import decode_triton, heads_triton, write_triton

    torch.manual_seed(0)
    model = tiny_model(name, **model_kw)
    ids = torch.randint(1, 200, (1, 30), generator=torch.Generator().manual_seed(1))
    calls = []
    _spy(monkeypatch, decode_triton, "decode_attention_triton", calls,
         lambda *a, **kw: ("decode", a[3].k.codes.shape[-1] * 4, kw.get("softcap")))  # (history k's D/4 code bytes)
    _spy(monkeypatch, write_triton, "rotate_quantize_triton", calls, lambda *a, **kw: ("write", a[0].shape[-1], None))
    _spy(monkeypatch, heads_triton, "heads_partials", calls,  # (the heads' split launch: merged or not)
         lambda *a, **kw: ("heads", a[0].shape[-1], kw.get("softcap")))
    logits = {}
    for kernels in (True, False):
        calls.clear()
        cache = OscarCache(model.config, method="hadamard", sink=4, recent=8, group_size=32, use_kernels=kernels,
                           compile=False, **cache_kw)
        steps = []
        with torch.no_grad():
            steps.append(model(ids[:, :20], **cache_kwargs(model, cache), use_cache=True).logits[:, -1])
            for j in range(20, ids.shape[1]):
                steps.append(model(ids[:, j : j + 1], **cache_kwargs(model, cache), use_cache=True).logits[:, -1])
        logits[kernels] = torch.stack(steps)
        if kernels:
            kinds = set(calls)
            assert ("decode", d, softcap) in kinds and ("write", d, None) in kinds, kinds
            assert ("heads", d, softcap) in kinds if cache_kw else True, kinds
        else:
            assert not calls
    assert rel_err(logits[True], logits[False]) < 1e-4
