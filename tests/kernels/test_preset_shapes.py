"""The authors' preset's shapes on the kernels (``OscarConfig.reference()`` at head_dim 128: one group of 128 channels
per head, float32 scale / zero): the write kernel, the split-K decode op (the Triton split kernel serves them; the
Gluon history kernel takes G = 64 bf16 only) and a whole cache, each against the torch reference, under the Triton
interpreter on the CPU (compiled on a GPU: ``benchmarks/bench_kernels.py --group-size 128 --meta-dtype float32``)."""
from __future__ import annotations

import pytest
import torch
from kernel_utils import loose, random_rotation, rel_err, rotating, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from decode_cases import _dt, assert_partials_close, make_case  # noqa: E402
from test_write_path import check_against_reference  # noqa: E402

from oscar_hf import OscarCache, OscarConfig  # noqa: E402
from oscar_hf.compat import cache_kwargs  # noqa: E402
from oscar_hf.kernels import plan  # noqa: E402
from oscar_hf.kernels.int2_attention import (decode_attention_reference, history_partial_reference,  # noqa: E402
                                             rotate_query_reference)
from oscar_hf.kernels.write_path import rotate_quantize, rotate_quantize_reference  # noqa: E402

from tiny_models import tiny_model  # noqa: E402

interp = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter tests (TRITON_INTERPRET=1 without CUDA)")

D = G = 128
META = torch.float32


def _decode_args(b, hk, m, n, w, seed):
    """One decode call at the preset's shape: fp32-metadata INT2 history (clips 0.96 / 0.92), a bf16 window
    (sink + recent), rotations, no offsets (the preset does not center)."""
    q, k, v, gen = make_case(b, hk, m, n, D, G, meta=META, seed=seed)
    assert k.scale.dtype == META and k.scale.shape[-1] == 1  # one group per head
    q = q.to(torch.bfloat16).float()  # the model's query: the window's (bf16) and the rotated one are the same
    r_k, r_v = random_rotation(hk, D, gen), random_rotation(hk, D, gen)
    q_rot, _ = rotate_query_reference(q, r_k, None)
    win = lambda s: (torch.randn(b, hk, w, D, generator=gen) * s).to(torch.bfloat16) if w else None  # noqa: E731
    return dict(q_rot=q_rot, k=k, v=v, start=torch.tensor([0, 9][:b]), key_mask=None, qk_offset=None,
                scaling=D**-0.5, group_size=G, q_win=q.to(torch.bfloat16), k_win=win(2.0), v_win=win(1.0),
                win_mask=None, r_v=r_v, mu_v=None, out_dtype=torch.float32), (q, r_k)


@interp
@pytest.mark.parametrize("b,hk,m,n,w", [(1, 2, 4, 300, 320), (2, 1, 8, 130, 70), (1, 2, 1, 65, 0)])
def test_decode_op_at_preset_shape(monkeypatch, b, hk, m, n, w):
    dt = _dt()
    monkeypatch.setattr(plan, "device_sms", lambda device: 16)  # several splits per call on the CPU
    args, (qf, r_k) = _decode_args(b, hk, m, n, w, seed=n + w)
    assert dt.kernel_supported(args["q_rot"], args["k"], G, None, None, w)  # served by the kernels, not the reference
    ref = loose(decode_attention_reference)(**args)
    got = loose(dt.decode_attention_triton)(**args)
    assert got.shape == (b, hk, m, D) and rel_err(got, ref) < 2e-5
    # the history partial alone (the combine's input)
    part = dt.history_partial_triton(args["q_rot"], args["k"], args["v"], args["start"], None, None, D**-0.5, G)
    assert_partials_close(part, history_partial_reference(args["q_rot"], args["k"], args["v"], args["start"], None,
                                                          None, D**-0.5, G), 5e-5)
    # from the unrotated query (the caches' call, through the dispatcher)
    rot = {k_: v_ for k_, v_ in args.items() if k_ not in ("q_rot", "qk_offset", "q_win")}
    got_r = rotating(qf, r_k, None, **rot, use_kernels=True)
    assert rel_err(got_r, ref) < 2e-5


@interp
@pytest.mark.parametrize("t,clip", [(1, 0.96), (70, 0.92)])  # a demoted token; a prefill chunk over one block
def test_write_path_at_preset_shape(t, clip):
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(2, 2, t, D, generator=gen)
    x[..., :4] *= 8.0  # outlier channels, as in real keys
    x = x.to(torch.bfloat16)
    r = random_rotation(2, D, gen)
    got = rotate_quantize(x, r, None, clip, G, META, use_kernels=True)
    assert got.scale.dtype == META and got.scale.shape == (2, 2, t, 1)
    check_against_reference(got, x, r, None, clip, G, META)
    ref = rotate_quantize_reference(x, r, None, clip, G, META)
    assert not torch.equal(got.scale, got.scale.to(torch.bfloat16).to(META))  # fp32 metadata is not bf16-rounded
    assert rel_err(got.scale, ref.scale) < 1e-5 and rel_err(got.zero, ref.zero) < 1e-5


@interp
def test_cache_with_the_preset_at_head_dim_128():
    """A model of head_dim 128 under the preset (G = 128, fp32 metadata): prefill + decode steps with the kernels
    (write path and decode op) give the reference's logits."""
    model = tiny_model("llama", head_dim=128, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    cfg = OscarConfig.reference(sink=4, recent=8).for_head_dim(128)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kernels in (True, False):
        cache = OscarCache(model.config, config=cfg, use_kernels=kernels)
        steps = []
        with torch.no_grad():
            out = model(ids[:, :40], **cache_kwargs(model, cache), use_cache=True)
            steps.append(out.logits[:, -1])
            for j in range(40, 48):
                steps.append(model(ids[:, j : j + 1], **cache_kwargs(model, cache), use_cache=True).logits[:, -1])
        layer = next(layer for layer in cache.layers if hasattr(layer, "memory"))
        assert layer.config.group_size == 128 and layer.config.torch_meta_dtype == META
        logits[kernels] = torch.stack(steps)
    assert rel_err(logits[True], logits[False]) < 1e-4
