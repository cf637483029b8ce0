"""The compiled storage's decode op (``oscar::decode_step_``, :mod:`oscar_hf.kernels.static_op`): one layer's write
and attention in one call. Its output against the reads' references on the written state (the INT2 heads from their
rotated query, the retrieval heads in place, merged at their KV heads), its writes against the write's reference;
under ``torch.compile(fullgraph=True)`` one opaque call on the graph's inputs as they are; its bad arguments.
"""
from __future__ import annotations

import re

import pytest
import torch
from kernel_utils import HAS_CUDA, heads_loose, loose, rel_err, ring_write, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from test_append_token import Layer, _tokens, assert_same  # noqa: E402

from oscar_hf.kernels.heads_attention import heads_decode_reference  # noqa: E402
from oscar_hf.kernels.int2_attention import decode_attention_reference, rotate_query_reference  # noqa: E402
from oscar_hf.kernels.static_op import (NO_HEADS, _write_stream, decode_step, decode_step_, step_config,  # noqa: E402
                                        step_heads, step_storage)
from oscar_hf.kernels import write_path  # noqa: E402

append_token_reference = ring_write(write_path.append_token_reference)


def decode_step_op(*args):
    """The op as the compiled layer calls it: the opaque op while torch.compile traces, the function in eager code."""
    return decode_step_(*args) if torch.compiler.is_compiling() else decode_step(*args)


S0, W, N, G = 2, 2, 12, 16
# (KV head -> INT2 history head, -1: a retrieval head; the retrieval heads' bits): none, INT8, 16-bit, all coded
CASES = [(None, None), ([1, -1, 0], 8), ([-1, 0, 1], 16), ([-1, -1, -1], 8)]


def _indices(layer):
    """``(hist_of, int2_idx, coded_of, coded_idx)`` of a test layer (None where it has no retrieval head)."""
    if layer.heads is None:
        return None, None, None, None
    hist_of, dev = layer.heads, layer.heads.device
    of = hist_of.tolist()
    int2_idx = torch.tensor(sorted((h for h in range(len(of)) if of[h] >= 0), key=lambda h: of[h]), dtype=torch.long,
                            device=dev)
    coded_idx = torch.tensor([h for h in range(len(of)) if of[h] < 0], dtype=torch.long, device=dev)
    return hist_of, int2_idx, layer.coded_of, coded_idx


def _storage(layer, use_kernels="auto", win=None) -> tuple:
    """The op's last arguments: the layer's StepStorage, StepHeads and StepConfig. A layer with retrieval heads gets
    their stores stacked as the compiled storage keeps them, its ``coded_k/coded_v`` rebound to views of them (the op
    writes the stacked tensors)."""
    storage = step_storage(layer.win_kv if win is None else win, layer.codes_kv, layer.meta_kv, None, None,
                           torch.stack([layer.r_k, layer.r_v]), layer.clip_k, layer.clip_v)
    heads = NO_HEADS
    if layer.coded_bits is not None:
        hist_of, int2_idx, coded_of, coded_idx = _indices(layer)
        cx = torch.stack([layer.coded_k[0], layer.coded_v[0]])  # [2, B, P, N, X]
        cmeta = None if layer.coded_bits == 16 else torch.stack([torch.stack(list(c[1:]))
                                                                 for c in (layer.coded_k, layer.coded_v)])
        layer.coded_k, layer.coded_v = ((cx[i],) if cmeta is None else (cx[i], *cmeta[i]) for i in (0, 1))
        heads = step_heads(torch.cat([hist_of, coded_of, int2_idx, coded_idx]), cx, cmeta)
    return (*storage, *heads, *step_config(layer.g, layer.meta, layer.sink, layer.recent, use_kernels, "minmax",
                                           layer.coded_bits or 0, 64))


def _step_args(layer, q, new_k, new_v, t, pad, win_mask, sinks, softcap, int2_idx=None):
    """The op's per-step arguments: the INT2 heads' rotated query from the grouped query ``q [B, Hk, g, D]``."""
    if int2_idx is None:
        _, int2_idx, _, _ = _indices(layer)
    q_rot = qk_off = None
    if layer.codes_kv.shape[2]:
        qi = q if int2_idx is None else q.index_select(1, int2_idx)
        q_rot, qk_off = rotate_query_reference(qi.float(), layer.r_k, layer.mu_k)
        q_rot = q_rot.contiguous()
    hist_len = torch.tensor(max(t - W - S0, 0))
    return (q, q_rot, qk_off, new_k, new_v, torch.tensor(t), pad, win_mask, hist_len, layer.mu_k, layer.mu_v, 0.3,
            torch.float32, sinks, softcap)


def _read_reference(layer, args):
    """The step's output from the references, on the state after the write: per KV head, its INT2 or coded read."""
    q, q_rot, qk_off, _, _, _, pad, win_mask, hist_len, _, mu_v, scaling, _, sinks, softcap = args
    hist_of, int2_idx, _, coded_idx = _indices(layer)
    out = torch.zeros(q.shape)
    if q_rot is not None:
        ii = torch.arange(q.shape[1]) if int2_idx is None else int2_idx
        sel = lambda x: x.index_select(1, ii)  # noqa: E731
        out[:, ii] = loose(decode_attention_reference)(
            q_rot, layer.hist_k, layer.hist_v, pad, None, qk_off, scaling, layer.g, sel(q), sel(layer.win_k),
            sel(layer.win_v), win_mask, layer.r_v, mu_v, torch.float32, n_valid=hist_len, softcap=softcap or None,
            sinks=None if sinks is None else sinks[ii])
    if coded_idx is not None and len(coded_idx):
        out[:, coded_idx] = heads_loose(heads_decode_reference)(
            q, coded_idx, layer.coded_k, layer.coded_v, layer.coded_bits, pad, hist_len, layer.win_k, layer.win_v,
            win_mask[:, 0, 0], scaling, torch.float32, softcap=softcap or None,
            sinks=None if sinks is None else sinks[coded_idx])
    return out


def _case(heads, bits, b=2, hk=3, d=32, seed=5):
    layer = Layer(b, hk, d, G, S0, W, W + 4, N, heads=heads, mu_k="3d", seed=seed, coded_bits=bits)
    gen = torch.Generator().manual_seed(seed)
    g = 2
    win_mask = torch.rand(b, 1, 1, S0 + W + 4, generator=gen) > 0.3
    win_mask[..., S0] = True  # every row reads at least one window key
    sinks = torch.randn(hk, g, generator=gen)
    return layer, gen, g, win_mask, sinks


@pytest.mark.parametrize("use_kernels", [False, pytest.param(True, marks=pytest.mark.skipif(
    not INTERPRETED, reason="the kernels' path under the CPU interpreter"))])
@pytest.mark.parametrize("heads,bits", CASES)
def test_decode_step_writes_then_reads(heads, bits, use_kernels):
    """Over the steps that fill the window and the history: the op's writes are the write's reference's, and its
    output is the INT2 heads' and the retrieval heads' reference reads of the written state, each at its KV heads
    (left padding, per-sequence mu_K, a masked window, attention sinks, soft-capping)."""
    layer, gen, g, win_mask, sinks = _case(heads, bits)
    ref = layer.clone()
    pad = torch.tensor([0, 3])
    b, hk, _, d = layer.win_k.shape
    for t in range(S0 + W + 5):
        new_k, new_v = _tokens(ref, t)
        append_token_reference(*ref.args(new_k, new_v, torch.tensor(t), pad), **ref.coded())
        q = torch.randn(b, hk, g, d, generator=gen).to(torch.bfloat16)
        args = _step_args(layer, q, new_k, new_v, t, pad, win_mask, sinks if t % 2 else None, 2.0 if t == 4 else 0.0)
        out = decode_step(*args, *_storage(layer, use_kernels))
        assert_same(layer, ref, f"T={t}")
        want = _read_reference(ref, args)
        assert out.shape == q.shape and out.dtype == torch.float32
        assert rel_err(out, want) < (2e-5 if use_kernels else 1e-6), f"T={t}"


@pytest.mark.parametrize("heads,bits", CASES[:2])
def test_op_compiled_matches_eager(heads, bits):
    """The op inside a compiled step (fullgraph, Inductor on CPU) writes and reads as the eager call: the generated
    code calls it once on the graph's inputs themselves (the stacked tensors, no view of them), and neither copies
    them nor writes them back."""
    from torch._inductor.utils import run_and_get_code

    layer, gen, g, win_mask, sinks = _case(heads, bits, seed=11)
    ref = layer.clone()
    pad = torch.tensor([0, 2])
    b, hk, _, d = layer.win_k.shape

    int2_idx = _indices(layer)[1]

    def step(q, new_k, new_v, length, storage):
        args = _step_args(layer, q, new_k, new_v, 0, pad, win_mask, sinks, 0.0, int2_idx)
        hist_len = (length - W - S0).clamp(min=0)
        out = decode_step_op(*args[:5], length, pad, win_mask, hist_len, *args[9:], *storage)
        length.add_(1)
        return out

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    length = torch.tensor(0)
    for t in range(S0 + W + 4):
        new_k, new_v = _tokens(ref, t)
        q = torch.randn(b, hk, g, d, generator=gen).to(torch.bfloat16)
        want = decode_step(*_step_args(ref, q, new_k, new_v, t, pad, win_mask, sinks, 0.0), *_storage(ref))
        if t == 0:
            out, (code, *_) = run_and_get_code(compiled, q, new_k, new_v, length, _storage(layer))
            assert code.count("torch.ops.oscar.decode_step_.default(") == 1
            assert not re.search(r"\bclone\(|\.copy_\(", code)  # no copy of the storage, none written back
            call = code[code.index("torch.ops.oscar.decode_step_.default(") :].split("\n")[0]
            assert "reinterpret_tensor(arg" not in call, call  # the inputs as they are, no view of them
        else:
            out = compiled(q, new_k, new_v, length, _storage(layer))
        assert int(length) == t + 1
        assert_same(layer, ref, f"T={t}")
        assert rel_err(out, want) < 1e-5, f"T={t}"  # (the rotation's matmul: Inductor's summation order)


def test_bad_arguments():
    """A clear error where the layer's arguments are built: a use_kernels that is none of 'auto', True, False; a
    window that is one half of the stacked keys and values; the same from the op itself, eager or traced."""
    layer, *_ = _case(None, None)
    with pytest.raises(ValueError, match="use_kernels"):
        _storage(layer, use_kernels="yes")
    with pytest.raises(ValueError, match="win must have 5 dimensions"):
        _storage(layer, win=layer.win_k)
    storage = list(_storage(layer))
    storage[1] = layer.codes_kv[0]  # (StepStorage.codes)
    b, hk, _, d = layer.win_k.shape
    new_k, new_v = _tokens(layer, 0)
    args = _step_args(layer, torch.zeros(b, hk, 2, d, dtype=torch.bfloat16), new_k, new_v, 0, torch.tensor([0, 0]),
                      torch.ones(b, 1, 1, S0 + W + 4, dtype=torch.bool), None, 0.0)
    with pytest.raises(ValueError, match="codes must have 5 dimensions"):
        decode_step_op(*args, *storage)
    with pytest.raises(Exception, match="codes must have 5 dimensions"):
        torch.compile(lambda: decode_step_op(*args, *storage), fullgraph=True, backend="eager")()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs CUDA (compiled kernels)")
@pytest.mark.parametrize("heads,bits", CASES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("beside", [False, True])
def test_gpu_decode_step(heads, bits, d, beside, monkeypatch):
    """On CUDA the op's kernels (the fused write, the split-K read with a device-side length, the retrieval heads'
    read) under a CUDA graph: its writes within the write kernel's tolerance of the reference's, its output the
    references' reads of the state it wrote, replayed as the length grows; ``beside``: the write split, its demotion
    on a side stream beside the read (``WriteDefaults.beside_max_batch`` at or above the batch), else one launch."""
    import dataclasses

    from oscar_hf.kernels import settings

    monkeypatch.setattr(settings, "WRITE_DEFAULTS", dataclasses.replace(settings.WRITE_DEFAULTS,
                                                                        beside_max_batch=2 if beside else 1))
    from test_append_token import assert_kernel_matches

    b, hk, g = 2, len(heads) if heads else 3, 4
    layer = Layer(b, hk, d, 64, S0, W, W + 4, 96, heads=heads, mu_k="3d", seed=d, coded_bits=bits, device="cuda")
    ref = layer.clone().to("cpu")
    gen = torch.Generator().manual_seed(d)
    pad = torch.tensor([0, 3], device="cuda")
    win_mask = torch.ones(b, 1, 1, S0 + W + 4, dtype=torch.bool, device="cuda")
    sinks = torch.randn(hk, g, generator=gen).cuda()
    length, storage, int2_idx = torch.zeros((), dtype=torch.long, device="cuda"), _storage(layer, True), _indices(layer)[1]
    assert (_write_stream(storage[0], True) is not None) == beside  # the write this case runs: split, or one launch
    q = torch.zeros(b, hk, g, d, dtype=torch.bfloat16, device="cuda")
    new = [torch.zeros(b, hk, 1, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]

    def step():
        args = _step_args(layer, q, *new, 0, pad, win_mask, sinks, 0.0, int2_idx)
        hist_len = (length - W - S0).clamp(min=0)
        out = decode_step_op(*args[:5], length, pad, win_mask, hist_len, *args[9:], *storage)
        length.add_(1)
        return out

    for t in range(3):  # (warm-up: the kernels' JIT and the plan's buffers, outside the capture)
        new_k, new_v = _tokens(ref, t)
        append_token_reference(*ref.args(new_k, new_v, torch.tensor(t), pad.cpu()), **ref.coded())
        new[0].copy_(new_k), new[1].copy_(new_v)
        step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    length.fill_(3)
    for t in range(3, S0 + W + 90):
        new_k, new_v = _tokens(ref, t)
        append_token_reference(*ref.args(new_k, new_v, torch.tensor(t), pad.cpu()), **ref.coded())
        q.copy_(torch.randn(q.shape, generator=gen))
        new[0].copy_(new_k), new[1].copy_(new_v)
        graph.replay()
        got = layer.clone().to("cpu")
        (assert_kernel_matches if got.codes_kv.shape[2] else assert_same)(got, ref)  # (no INT2 head: codes exact)
        args = _step_args(got, q.cpu(), new_k, new_v, t, pad.cpu(), win_mask.cpu(), sinks.cpu(), 0.0)
        assert rel_err(out.cpu(), _read_reference(got, args)) < 2e-2, f"T={t}"
