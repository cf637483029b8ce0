"""The static cache's one-token write step (``write_path.append`` at a ``Ring``): the torch reference against a naive
loop model of its semantics, the fused Triton kernel against the reference (interpreter on CPU; compiled on CUDA with
``-m gpu``), both also split in two (the demotion alone, the new token alone: ``WriteDefaults.beside_max_batch``).
The compiled storage's op that calls it: ``test_static_op.py``.
"""
from __future__ import annotations

import pytest
import torch
from kernel_utils import (HAS_CUDA, CodedSlots, append_token, assert_int2_rows_close, random_rotation, ring_write,
                          setup_interpreter, signed_permutation)

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from oscar_hf.kernels import write_path  # noqa: E402

append_token_reference = ring_write(write_path.append_token_reference)
demote_reference = ring_write(lambda params, new_k, new_v, *rest: write_path.demote_reference(params, *rest))
from oscar_hf.kernels.kv import Ring  # noqa: E402
from oscar_hf.quant import QuantizedRows, encode_heads, quantize_rows  # noqa: E402

interp = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter tests (TRITON_INTERPRET=1 without CUDA)")


def _triton():
    from oscar_hf.kernels.append_triton import append_token_triton

    return ring_write(append_token_triton)


# ------------------------------------------------------------------------------------------------- fixtures


class Layer:
    """One layer's storage and constants, with random initial contents (so a wrong or missing write shows)."""

    def __init__(self, b, hk, d, g, sink, recent, ring, n, *, heads=None, mu_k="2d", mu_v=True, dtype=torch.bfloat16,
                 meta=torch.bfloat16, exact=False, seed=0, device="cpu", coded_bits=None):
        gen = torch.Generator().manual_seed(seed)
        self.sink, self.recent, self.g, self.meta = sink, recent, g, meta
        self.heads = torch.tensor(heads, dtype=torch.long) if heads is not None else None
        hq = hk if heads is None else sum(h >= 0 for h in heads)
        win_k = torch.randn(b, hk, sink + ring, d, generator=gen).to(dtype)
        win_v = torch.randn(b, hk, sink + ring, d, generator=gen).to(dtype)

        def hist():
            return QuantizedRows(torch.randint(0, 256, (b, hq, n, d // 4), generator=gen, dtype=torch.uint8),
                                 torch.rand(b, hq, n, d // g, generator=gen).to(meta),
                                 torch.randn(b, hq, n, d // g, generator=gen).to(meta))

        hist_k, hist_v = hist(), hist()
        # stored as the compiled storage keeps them (keys at 0, values at 1), read through the views below
        self.win_kv = torch.stack([win_k, win_v])  # [2, B, Hk, S0 + R, D]
        self.codes_kv = torch.stack([hist_k.codes, hist_v.codes])  # [2, B, H2, N, D/4]
        self.meta_kv = torch.stack([torch.stack([h.scale, h.zero]) for h in (hist_k, hist_v)])  # [2, 2, B, H2, N, D/G]
        # exact: signed permutations, so (x - mu) @ r is exact in fp32 whatever the summation order
        rot = signed_permutation if exact else random_rotation
        self.r_k, self.r_v = rot(hq, d, gen), rot(hq, d, gen)
        self.mu_k = {None: None, "2d": torch.randn(hq, d, generator=gen),
                     "3d": 4.0 * torch.randn(b, hq, d, generator=gen)}[mu_k]
        self.mu_v = torch.randn(hq, d, generator=gen) if mu_v else None
        self.clip_k, self.clip_v = 0.95, 0.9
        # the retrieval heads' coded stores (the heads marked -1), random like the rest
        self.coded_bits, self.coded_k, self.coded_v, self.coded_of = coded_bits, None, None, None
        if coded_bits is not None:
            p = hk - hq
            self.coded_of = torch.tensor([-1] * hk, dtype=torch.long)
            self.coded_of[[h for h in range(hk) if heads[h] < 0]] = torch.arange(p)

            def coded():
                if coded_bits == 16:
                    return (torch.randn(b, p, n, d, generator=gen).to(dtype),)
                return (torch.randint(0, 256, (b, p, n, d * coded_bits // 8), generator=gen, dtype=torch.uint8),
                        torch.rand(b, p, n, 1, generator=gen).to(dtype), torch.randn(b, p, n, 1, generator=gen).to(dtype))

            self.coded_k, self.coded_v = coded(), coded()
        self.to(device)

    win_k = property(lambda self: self.win_kv[0])
    win_v = property(lambda self: self.win_kv[1])
    hist_k = property(lambda self: QuantizedRows(self.codes_kv[0], self.meta_kv[0, 0], self.meta_kv[0, 1]))
    hist_v = property(lambda self: QuantizedRows(self.codes_kv[1], self.meta_kv[1, 0], self.meta_kv[1, 1]))

    def _mapped(self, new, fn):
        """``new`` given this layer's fields, ``fn`` applied to each tensor (alone, in QuantizedRows or a tuple)."""
        for name, v in vars(self).items():
            if isinstance(v, torch.Tensor):
                v = fn(v)
            elif isinstance(v, QuantizedRows):
                v = QuantizedRows(*(fn(x) for x in v))
            elif isinstance(v, tuple):
                v = tuple(fn(x) for x in v)
            setattr(new, name, v)
        return new

    def to(self, device):
        return self._mapped(self, lambda x: x.to(device))

    def clone(self):
        return self._mapped(object.__new__(Layer), torch.clone)

    def tensors(self):
        return [self.win_kv, self.codes_kv, self.meta_kv, *(self.coded_k or ()), *(self.coded_v or ())]

    def coded(self) -> dict:
        """``coded=`` of the write (the retrieval heads' stores), or nothing."""
        if self.coded_bits is None:
            return {}
        return dict(coded=CodedSlots(self.coded_k, self.coded_v, self.coded_of, self.coded_bits))

    def args(self, new_k, new_v, length, pad):
        """The positional arguments of append_token_reference / append_token_triton."""
        return (new_k, new_v, self.win_k, self.win_v, self.hist_k, self.hist_v, length, pad, self.heads, self.r_k,
                self.mu_k, self.clip_k, self.r_v, self.mu_v, self.clip_v, self.g, self.meta, self.sink, self.recent)


def _tokens(layer, step, device="cpu"):
    gen = torch.Generator().manual_seed(1000 + step)
    b, hk, _, d = layer.win_k.shape
    shape = (b, hk, 1, d)
    return (torch.randn(shape, generator=gen).to(layer.win_k.dtype).to(device),
            torch.randn(shape, generator=gen).to(layer.win_v.dtype).to(device))


def naive_step(layer, new_k, new_v, t: int, pad: list[int]):
    """The semantics, one (row, head) at a time with python ints: demote slot T - W (its ring entry is not the new
    token's: R > W), then write the new token into its ring entry and, while filling, the row's sink."""
    s0, w = layer.sink, layer.recent
    b_, hk, slots, _ = layer.win_k.shape
    ring, n = slots - s0, layer.hist_k.codes.shape[2]
    s = t - w
    if s >= s0 and s - s0 < n:
        for b in range(b_):
            for h in range(hk):
                hh = h if layer.heads is None else int(layer.heads[h])
                if hh < 0:
                    if layer.coded_bits is not None:  # a retrieval head: the slot's row coded on its own
                        cp = int(layer.coded_of[h])
                        for win, store in ((layer.win_k, layer.coded_k), (layer.win_v, layer.coded_v)):
                            for dst, src in zip(store, encode_heads(win[b, h, s0 + s % ring][None], layer.coded_bits)):
                                dst[b, cp, s - s0] = src[0]
                    continue
                for win, hist, r, mu, clip in ((layer.win_k, layer.hist_k, layer.r_k, layer.mu_k, layer.clip_k),
                                               (layer.win_v, layer.hist_v, layer.r_v, layer.mu_v, layer.clip_v)):
                    x = win[b, h, s0 + s % ring].float()
                    if mu is not None:
                        x = x - (mu[b, hh] if mu.dim() == 3 else mu[hh])
                    q = quantize_rows((x @ r[hh])[None], layer.g, clip, layer.meta)
                    for dst, src in zip(hist, q):
                        dst[b, hh, s - s0] = src[0]
    for b in range(b_):
        for win, new in ((layer.win_k, new_k), (layer.win_v, new_v)):
            win[b, :, s0 + t % ring] = new[b, :, 0]
            if 0 <= t - pad[b] < s0:
                win[b, :, t - pad[b]] = new[b, :, 0]


def assert_same(a: Layer, b: Layer, what=""):
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(x, y), what


def assert_kernel_matches(got: Layer, ref: Layer):
    """Window bytes identical; history metadata within an ulp of the stored dtype (+1e-3 of the range), codes equal
    but for rounding ties (a matvec summed in another order lands a value on the other side of a half-step)."""
    for x, y in ((got.win_k, ref.win_k), (got.win_v, ref.win_v)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    for qg, qr in ((got.hist_k, ref.hist_k), (got.hist_v, ref.hist_v)):
        assert_int2_rows_close(qg, qr, got.meta)
    for a, b in zip((got.coded_k or ()) + (got.coded_v or ()), (ref.coded_k or ()) + (ref.coded_v or ())):
        assert torch.equal(a, b), "retrieval heads' codes differ (no matvec: they must be exact)"


# ------------------------------------------------------------------------------------- (a) reference vs loop model


@pytest.mark.parametrize(
    "heads,ring_extra,mu_k,meta,dtype,coded_bits",
    [
        (None, 0, "2d", torch.bfloat16, torch.bfloat16, None),  # R = W + 1: the smallest ring
        ([1, -1, 0], 2, "3d", torch.bfloat16, torch.bfloat16, None),  # R > W + 1; head 1 not INT2; per-row mu_k
        ([-1, 0, 1], 0, None, torch.float16, torch.float32, None),  # no offsets, fp16 metadata, fp32 window
        ([1, -1, 0], 2, "3d", torch.bfloat16, torch.bfloat16, 8),  # head 1 a retrieval head, coded INT8 ...
        ([-1, 0, -1], 0, None, torch.float16, torch.float16, 4),  # ... INT4 (two of them)
        ([1, -1, 0], 0, "2d", torch.bfloat16, torch.float32, 16),  # ... as it is
    ],
)
def test_reference_matches_loop_model(heads, ring_extra, mu_k, meta, dtype, coded_bits):
    s0, w, n = 2, 3, 5
    layer = Layer(3, 3, 32, 16, s0, w, w + 1 + ring_extra, n, heads=heads, mu_k=mu_k, mu_v=mu_k is not None,
                  dtype=dtype, meta=meta, exact=True, seed=len(heads or []) + ring_extra, coded_bits=coded_bits)
    pad = [0, 1, 3]  # row 2 fills its sink at slots 3 and 4; 3 >= S0 so its slots 0..2 are padding
    model, parts = layer.clone(), layer.clone()
    first = layer.clone()
    demotions = 0
    # T = 0 .. S0 + W + N + 2: sink filling, the first demotion (T = S0 + W), the last history row, overflow
    for t in range(s0 + w + n + 3):
        new_k, new_v = _tokens(layer, t)
        append_token_reference(*layer.args(new_k, new_v, torch.tensor(t), torch.tensor(pad)), **layer.coded())
        naive_step(model, new_k, new_v, t, pad)
        assert_same(layer, model, f"T={t}")
        # its two parts (WriteDefaults.beside_max_batch): the demotion alone, the put alone (into the stacked window)
        demote_reference(*parts.args(None, None, torch.tensor(t), torch.tensor(pad)), **parts.coded())
        at = Ring(torch.tensor(t), torch.tensor(pad), s0, w)
        write_path.ring_put(parts.win_kv, torch.stack([new_k, new_v]), write_path.put_entries(at, w + 1 + ring_extra))
        assert_same(parts, model, f"T={t}")
        demotions += 0 <= t - w - s0 < n
    assert demotions == n
    # every history row was written once (random initial contents replaced), nothing else changed
    for now, then in ((layer.hist_k, first.hist_k), (layer.hist_v, first.hist_v), (layer.coded_k, first.coded_k),
                      (layer.coded_v, first.coded_v)):
        if now is not None:
            assert (now[0] != then[0]).any(-1).all()  # [B, H2 or P, N]


def test_reference_no_demotion_past_capacity():
    """Slot s with s - S0 >= N is not written anywhere (the history is left as it was)."""
    s0, w, n = 1, 2, 3
    layer = Layer(2, 2, 32, 32, s0, w, w + 1, n, exact=True, seed=3)
    before = layer.clone()
    t = s0 + w + n  # s - S0 = N
    new_k, new_v = _tokens(layer, t)
    append_token_reference(*layer.args(new_k, new_v, torch.tensor(t), torch.tensor([0, 0])))
    for a, b in zip(layer.hist_k + layer.hist_v, before.hist_k + before.hist_v):
        assert torch.equal(a, b)
    assert torch.equal(layer.win_k[:, :, s0 + t % (w + 1)], new_k[:, :, 0])


def test_bad_inputs():
    layer = Layer(2, 2, 32, 32, 1, 3, 4, 4)
    new_k, new_v = _tokens(layer, 0)
    t, pad = torch.tensor(5), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="ring"):
        append_token_reference(*layer.args(new_k, new_v, t, pad)[:-1], 4)  # recent 4 needs 5 ring entries
    with pytest.raises(ValueError, match="hist_heads"):
        args = list(layer.args(new_k, new_v, t, pad))
        args[8] = torch.tensor([0, 1, -1])
        append_token_reference(*args)
    with pytest.raises(ValueError, match="new_k"):
        append_token_reference(*layer.args(new_k.expand(2, 2, 2, 32), new_v, t, pad))
    with pytest.raises(ValueError, match="new_k"):  # one of the two rows missing
        append_token_reference(*layer.args(new_k, None, t, pad))
    with pytest.raises(ValueError, match="writes nothing"):  # the split's two halves: not both off
        append_token(*layer.args(None, None, t, pad), demote=False)


# ------------------------------------------------------------------------------------- (b) Triton kernel (interpreter)


@interp
@pytest.mark.parametrize(
    "b,hk,d,g,heads,ring_extra,mu_k,dtype,meta,quantizer,coded_bits",
    [
        (2, 2, 64, 32, None, 0, "2d", torch.bfloat16, torch.bfloat16, "minmax", None),
        (2, 3, 32, 32, [1, -1, 0], 2, "3d", torch.float16, torch.float16, "minmax", None),
        (1, 2, 64, 16, [-1, 0], 1, None, torch.float32, torch.float32, "minmax", None),
        (2, 3, 64, 32, [1, -1, 0], 1, "3d", torch.bfloat16, torch.bfloat16, "std", None),
        (2, 3, 64, 32, [1, -1, 0], 1, "3d", torch.bfloat16, torch.bfloat16, "minmax", 8),
        (2, 3, 32, 32, [-1, 0, -1], 0, None, torch.float16, torch.float16, "minmax", 4),
        (1, 2, 64, 16, [-1, 0], 1, "2d", torch.float32, torch.float32, "minmax", 8),
        (2, 2, 64, 32, [0, -1], 2, "2d", torch.bfloat16, torch.bfloat16, "minmax", 16),
        # D = 96 (plane-padded layout; a retrieval head's INT4 halves of 48 padded to 64 lanes), D = 512 (8 warps)
        (2, 3, 96, 32, [1, -1, 0], 1, "3d", torch.bfloat16, torch.bfloat16, "minmax", 4),
        (1, 2, 96, 96, [-1, 0], 0, "2d", torch.float16, torch.float16, "std", 8),
        (2, 2, 96, 48, None, 1, None, torch.bfloat16, torch.bfloat16, "minmax", None),
        (1, 3, 512, 64, [0, -1, 1], 1, "2d", torch.bfloat16, torch.bfloat16, "minmax", 16),
    ],
)
def test_kernel_matches_reference(b, hk, d, g, heads, ring_extra, mu_k, dtype, meta, quantizer, coded_bits):
    s0, w, n = 2, 2, 3
    ref = Layer(b, hk, d, g, s0, w, w + 1 + ring_extra, n, heads=heads, mu_k=mu_k, mu_v=mu_k is not None,
                dtype=dtype, meta=meta, seed=d + g, coded_bits=coded_bits)
    got, minmax, parts = ref.clone(), ref.clone(), ref.clone()
    pad = torch.tensor([1, 0][:b])
    for t in range(s0 + w + n + 2):
        new_k, new_v = _tokens(ref, t)
        append_token_reference(*ref.args(new_k, new_v, torch.tensor(t), pad), quantizer=quantizer, **ref.coded())
        _triton()(*got.args(new_k, new_v, torch.tensor(t), pad), quantizer=quantizer, **got.coded())
        assert_kernel_matches(got, ref)
        # split as WriteDefaults.beside_max_batch splits it: the new token alone, then the demotion alone
        _triton()(*parts.args(new_k, new_v, torch.tensor(t), pad), quantizer=quantizer, demote=False, **parts.coded())
        _triton()(*parts.args(None, None, torch.tensor(t), pad), quantizer=quantizer, **parts.coded())
        assert_kernel_matches(parts, ref)
        append_token_reference(*minmax.args(new_k, new_v, torch.tensor(t), pad), **minmax.coded())
    # "std" really is another grid than the default's
    assert torch.equal(minmax.hist_k.scale, ref.hist_k.scale) == (quantizer == "minmax")


@pytest.mark.parametrize("d", [64, 96, 128, 256, 512])
def test_launch_shape(d):
    """The write's rotation chunk: a power of two of R's rows that divides D (the loop has no mask), a tile that the
    warps' registers hold, between 4 and 16 warps, and the whole rotation in one step where 16 warps hold it."""
    from oscar_hf.kernels import append_triton as at
    from oscar_hf.kernels.plan import next_pow2

    warps, k = at.launch_shape(d)
    assert k & (k - 1) == 0 and d % k == 0, (d, k)
    assert at.MIN_WARPS <= warps <= at.MAX_WARPS and warps & (warps - 1) == 0, (d, warps)
    assert k * next_pow2(d) <= warps * at.WARP_TILE, (d, warps, k)
    if d * next_pow2(d) <= at.MAX_WARPS * at.WARP_TILE and d & (d - 1) == 0:
        assert k == d, (d, k)


@interp
def test_dispatch(monkeypatch):
    """use_kernels=True runs the kernel (interpreter; head_dim 96 too); a head_dim the kernel does not take (80) goes to
    the reference; use_kernels=False is the reference."""
    import oscar_hf.kernels.append_triton as at

    launches = []
    real = at.append_token_triton
    monkeypatch.setattr(at, "append_token_triton",
                        lambda *a, **kw: (launches.append(a[1].shape[-1]), real(*a, **kw))[1])
    for d in (64, 96):
        ref = Layer(1, 2, d, 32, 1, 2, 3, 4, mu_k="3d", seed=7)
        got, off = ref.clone(), ref.clone()
        for t in range(6):
            new_k, new_v = _tokens(ref, t)
            append_token_reference(*ref.args(new_k, new_v, torch.tensor(t), torch.tensor([0])))
            append_token(*got.args(new_k, new_v, torch.tensor(t), torch.tensor([0])), use_kernels=True)
            append_token(*off.args(new_k, new_v, torch.tensor(t), torch.tensor([0])), use_kernels=False)
        assert_kernel_matches(got, ref)
        assert_same(off, ref)
    assert launches == [64] * 6 + [96] * 6
    ref = Layer(1, 1, 80, 16, 1, 1, 2, 3, seed=8)  # D = 80: not served
    got = ref.clone()
    for t in range(5):
        new_k, new_v = _tokens(ref, t)
        append_token_reference(*ref.args(new_k, new_v, torch.tensor(t), torch.tensor([0])))
        append_token(*got.args(new_k, new_v, torch.tensor(t), torch.tensor([0])), use_kernels=True)
    assert_same(got, ref)
    assert len(launches) == 12


# --------------------------------------------------------------------------------------------- (c) GPU, real shapes


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs CUDA (compiled kernels)")
@pytest.mark.parametrize("d,g", [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128), (96, 32), (96, 96), (512, 64),
                                 (512, 128)])
@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("quantizer", ["minmax", "std"])
def test_gpu_kernel_matches_reference(b, d, g, quantizer):
    s0, w, n, hk = 4, 16, 40, 8
    # cases with retrieval heads, coded at 8 / 4 / 16 bits
    heads = [0, 1, -1, 2, 3, 4, -1, 5] if g in (64, 96) else None
    coded_bits = {64: 8, 128: 4, 96: 4, 512: 8}[d] if heads and quantizer == "minmax" else 16 if heads else None
    ref = Layer(b, hk, d, g, s0, w, w + 1 + 64 * (g == 64), n, heads=heads, mu_k="3d" if b == 8 else "2d",
                seed=b + d + g, device="cuda", coded_bits=coded_bits)
    got = ref.clone()
    pad = torch.arange(b, device="cuda") * 3  # rows with and without left padding, some filling the sink late
    for t in range(s0 + w + n + 4):
        new_k, new_v = _tokens(ref, t, "cuda")
        length = torch.tensor(t, device="cuda")
        append_token_reference(*ref.args(new_k, new_v, length, pad), quantizer=quantizer, **ref.coded())
        _triton()(*got.args(new_k, new_v, length, pad), quantizer=quantizer, **got.coded())
    torch.cuda.synchronize()
    assert_kernel_matches(got.to("cpu"), ref.to("cpu"))
