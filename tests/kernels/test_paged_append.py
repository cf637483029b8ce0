"""The serving store's one-token write (``write_path.append`` at ``PagedRows``): the torch reference against a naive
loop model of its semantics, the Triton kernel against the reference (interpreter on CPU; compiled on CUDA with ``-m
gpu``), the dispatcher, and the store's decode step driving the kernel.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_utils import (HAS_CUDA, CodedSlots, assert_int2_rows_close, paged_append, paged_write, random_rotation,
                          setup_interpreter, signed_permutation)

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from oscar_hf.kernels import write_path  # noqa: E402
from oscar_hf.kernels.kv import PagedRows  # noqa: E402
from oscar_hf.quant import encode_heads, quantize_rows, unpack_bits1, unpack_int2  # noqa: E402
from oscar_hf.serving.pool import HeadLayout, PagedInt2Pool  # noqa: E402

paged_append_reference = paged_write(write_path.paged_append_reference)

interp = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter tests (TRITON_INTERPRET=1 without CUDA)")


def _triton():
    from oscar_hf.kernels.append_triton import paged_append_triton

    return paged_write(paged_append_triton)


# ------------------------------------------------------------------------------------------------- fixtures


class Paged:
    """One layer (layer 1 of 2) of a store's storage, with random contents so that a wrong or missing write shows: a
    window pool ``[slots + 1, 2, Hk, S0 + R, D]`` (the last slot the trash slot) viewed at the layer, and a
    :class:`PagedInt2Pool` with its trash page. ``heads``: None (every head INT2) or each KV head's INT2 index / -1
    (a retrieval head, coded at ``coded_bits``)."""

    def __init__(self, hk, d, g, *, heads=None, coded_bits=None, dtype=torch.bfloat16, meta=torch.bfloat16,
                 mu=True, exact=False, sink=2, recent=3, ring_extra=0, slots=6, pages=5, page_size=4, seed=0,
                 device="cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.sink, self.recent, self.ring = sink, recent, recent + 1 + ring_extra
        self.g, self.meta, self.dtype = g, meta, dtype
        self.heads = torch.tensor(heads, dtype=torch.long) if heads is not None else None
        hq = hk if heads is None else sum(h >= 0 for h in heads)
        f = hk - hq
        if f and coded_bits is None:
            raise ValueError("retrieval heads need coded_bits")
        self.pool = PagedInt2Pool(pages, 2, hk, d, page_size, g, meta, trash_page=True,
                                  layout=HeadLayout([hq] * 2, [f] * 2, coded_bits or 8, dtype))
        for t in (*self.pool.int2, *self.pool.coded):
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
            else:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        self.windows = [torch.randn(slots + 1, 2, hk, sink + self.ring, d, generator=gen).to(dtype) for _ in "kv"]
        rot = signed_permutation if exact else random_rotation
        self.r_k, self.r_v = rot(hq, d, gen), rot(hq, d, gen)
        self.mu_k = torch.randn(hq, d, generator=gen) if mu else None
        self.mu_v = torch.randn(hq, d, generator=gen) if mu else None
        self.clip_k, self.clip_v = 0.95, 0.9
        self.coded_bits, self.coded_of = coded_bits if f else None, None
        if f:
            self.coded_of = torch.full((hk,), -1, dtype=torch.long)
            self.coded_of[[h for h in range(hk) if heads[h] < 0]] = torch.arange(f)
        self.to(device)

    def to(self, device):
        self.pool.int2 = type(self.pool.int2)(*(t.to(device) for t in self.pool.int2))
        self.pool.coded = tuple(t.to(device) for t in self.pool.coded)
        for name, v in vars(self).items():
            if isinstance(v, torch.Tensor):
                setattr(self, name, v.to(device))
        self.windows = [w.to(device) for w in self.windows]
        return self

    def clone(self):
        new = object.__new__(Paged)
        new.__dict__.update(self.__dict__)
        new.pool = object.__new__(PagedInt2Pool)
        new.pool.__dict__.update(self.pool.__dict__)
        new.pool.int2 = type(self.pool.int2)(*(t.clone() for t in self.pool.int2))
        new.pool.coded = tuple(t.clone() for t in self.pool.coded)
        new.windows = [w.clone() for w in self.windows]
        return new

    @property
    def trash_slot(self) -> int:
        return self.windows[0].shape[0] - 1

    def coded(self) -> dict:
        if self.coded_bits is None:
            return {}
        return dict(coded=CodedSlots(self.pool.coded_rows(1, "k"), self.pool.coded_rows(1, "v"), self.coded_of,
                                     self.coded_bits))

    def args(self, new_k, new_v, rows):
        """The positional arguments of paged_append_reference / paged_append_triton / paged_append."""
        return (new_k, new_v, self.windows[0][:, 1], self.windows[1][:, 1], self.pool.rows(1, "k"),
                self.pool.rows(1, "v"), rows, self.heads, self.r_k, self.mu_k, self.clip_k, self.r_v, self.mu_v,
                self.clip_v, self.g, self.meta)

    def plan(self, ts, slots, tables, pos, device="cpu", padded=0):
        """:class:`PagedRows` of rows at ``ts`` tokens (as ``OscarPagedStore.plan_decode`` builds them), and
        ``padded`` rows on the trash slot."""
        s0, w, ring, p, trash = self.sink, self.recent, self.ring, self.pool.page_size, self.pool.trash_page
        fields = []
        for t, slot, table, q in zip(ts, slots, tables, pos):
            e = t - 1 - w - s0
            ne = s0 + t % ring
            fields.append((q, slot, ne, t if t < s0 else ne, s0 + (t - 1 - w) % ring,
                           table[e // p] if e >= 0 else trash, e % p if e >= 0 else 0))
        for k in range(padded):
            fields.append((len(ts) + k, self.trash_slot, s0, s0, s0, trash, 0))
        return PagedRows(*(torch.tensor(col, dtype=torch.long, device=device) for col in zip(*fields)))

    def tensors(self):
        return [*self.windows, *self.pool.int2, *self.pool.coded]


def _tokens(hk, q, d, dtype, seed, device="cpu"):
    """``[Hk, Q, D]`` keys and values of a packed batch, as a transposed view of ``[Q, Hk, D]`` (the projections'
    layout)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return tuple(torch.randn(q, hk, d, generator=gen).to(dtype).to(device).transpose(0, 1) for _ in "kv")


# rows: T tokens seen, window slot, block table, position in the packed batch. Row 0 fills its sink (demotes nothing:
# the trash page), row 1 demotes its first history entry, row 2 an entry in its second page, row 3 the last entry of
# a page; the rows sit in the packed batch out of order
TS, SLOTS, TABLES, POS = [1, 6, 11, 13], [3, 0, 4, 1], [[], [2], [4, 1], [3, 0, 2]], [2, 0, 3, 1]


def naive_step(layer: Paged, new_k, new_v, rows: PagedRows):
    """The semantics, one (row, head) at a time: demote the row's ring entry into its page entry (every INT2 head
    rotated, centered, clipped, quantized; every retrieval head coded), then write the new token into its ring and
    sink entries."""
    win = [w[:, 1] for w in layer.windows]
    hk = win[0].shape[1]
    for b in range(rows.pos.shape[0]):
        slot, de, page, off = (int(x[b]) for x in (rows.slots, rows.demote_entry, rows.demote_page, rows.demote_off))
        for h in range(hk):
            hh = h if layer.heads is None else int(layer.heads[h])
            for kind, w, r, mu, clip in (("k", win[0], layer.r_k, layer.mu_k, layer.clip_k),
                                         ("v", win[1], layer.r_v, layer.mu_v, layer.clip_v)):
                if hh < 0:
                    cp = int(layer.coded_of[h])
                    for dst, src in zip(layer.pool.coded_rows(1, kind), encode_heads(w[slot, h, de][None],
                                                                                      layer.coded_bits)):
                        dst[page, cp, off] = src[0]
                    continue
                x = w[slot, h, de].float()
                if mu is not None:
                    x = x - mu[hh]
                for dst, src in zip(layer.pool.rows(1, kind), quantize_rows((x @ r[hh])[None], layer.g, clip,
                                                                            layer.meta)):
                    dst[page, hh, off] = src[0]
    for b in range(rows.pos.shape[0]):
        slot, q = int(rows.slots[b]), int(rows.pos[b])
        for w, new in ((win[0], new_k), (win[1], new_v)):
            w[slot, :, int(rows.new_entry[b])] = new[:, q]
            w[slot, :, int(rows.sink_entry[b])] = new[:, q]


def assert_same(a: Paged, b: Paged, what=""):
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(x, y), what


def assert_kernel_matches(got: Paged, ref: Paged, exact: bool, skip_trash=False):
    """Windows and the retrieval heads' rows bit for bit; INT2 rows bit for bit with exact rotations (signed
    permutations: the matvec has one term per output), else metadata within an ulp of the stored dtype (+1e-3 of the
    range) and codes equal but for rounding ties (as ``test_append_token.assert_kernel_matches``). ``skip_trash``:
    the trash slot and page are left out (several rows wrote them, in an order the GPU does not fix)."""
    keep = slice(None, -1) if skip_trash else slice(None)
    for x, y in zip(got.windows, ref.windows):
        assert torch.equal(x[keep].view(torch.uint8), y[keep].view(torch.uint8)), "windows differ"
    for a, b in zip(got.pool.coded, ref.pool.coded):
        assert torch.equal(a[keep].view(torch.uint8), b[keep].view(torch.uint8)), "retrieval heads' rows differ"
    for kind in "kv":
        qg, qr = (x.pool.rows(1, kind) for x in (got, ref))
        qg, qr = type(qg)(*(t[keep] for t in qg)), type(qr)(*(t[keep] for t in qr))
        if exact or qr.codes.numel() == 0:
            for a, b in zip(qg, qr):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"INT2 {kind} rows differ"
            continue
        assert_int2_rows_close(qg, qr, got.meta)
    for kind in "kv":  # the other layer (0) is never touched
        for a, b in zip(got.pool.rows(0, kind), ref.pool.rows(0, kind)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "layer 0 changed"


def _changed(before: Paged, after: Paged) -> int:
    return sum(int((x != y).sum()) for x, y in zip(before.tensors(), after.tensors()))


# ------------------------------------------------------------------------------------- (a) reference vs loop model


@pytest.mark.parametrize(
    "heads,coded_bits,ring_extra,meta,dtype",
    [
        (None, None, 0, torch.bfloat16, torch.bfloat16),  # R = W + 1: the demoted entry is the new token's entry
        ([1, -1, 0], 8, 2, torch.float16, torch.float32),  # a retrieval head at INT8; R > W + 1
        ([-1, 0, -1], 4, 0, torch.float32, torch.float16),  # two at INT4
        ([1, -1, 0], 16, 1, torch.bfloat16, torch.bfloat16),  # one at 16 bits
        ([-1, -1, -1], 8, 0, torch.bfloat16, torch.bfloat16),  # no INT2 head
    ],
)
def test_reference_matches_loop_model(heads, coded_bits, ring_extra, meta, dtype):
    layer = Paged(3, 32, 16, heads=heads, coded_bits=coded_bits, dtype=dtype, meta=meta, exact=True,
                  ring_extra=ring_extra, seed=len(heads or []) + ring_extra)
    model, before = layer.clone(), layer.clone()
    rows = layer.plan(TS, SLOTS, TABLES, POS)
    new_k, new_v = _tokens(3, 4, 32, dtype, 0)
    paged_append_reference(*layer.args(new_k, new_v, rows), **layer.coded())
    naive_step(model, new_k, new_v, rows)
    assert_same(layer, model)
    # each row wrote its token twice at most and one entry of each head: nothing else changed
    for kind in "kv":
        for b in range(4):
            page, off = int(rows.demote_page[b]), int(rows.demote_off[b])
            for now, then in zip(layer.pool.rows(1, kind) + layer.pool.coded_rows(1, kind),
                                 before.pool.rows(1, kind) + before.pool.coded_rows(1, kind)):
                assert (now[page, :, off] != then[page, :, off]).any(-1).all()
                now[page, :, off] = then[page, :, off]
    for w, w0 in zip(layer.windows, before.windows):
        for b in range(4):
            for e in (rows.new_entry[b], rows.sink_entry[b]):
                w[rows.slots[b], 1, :, e] = w0[rows.slots[b], 1, :, e]
    assert_same(layer, before)


def test_reference_flags():
    """``demote=False`` writes no page (not even the trash page); ``write_sink=False`` leaves the sink alone."""
    layer = Paged(2, 32, 32, seed=4)
    before = layer.clone()
    rows = layer.plan([2, 3], [0, 1], [[], []], [0, 1])  # both rows fill their sink (S0 = 2: row 1 no longer)
    new_k, new_v = _tokens(2, 2, 32, layer.dtype, 4)
    paged_append_reference(*layer.args(new_k, new_v, rows), demote=False, write_sink=False)
    for a, b in zip(layer.pool.int2, before.pool.int2):
        assert torch.equal(a, b)
    assert torch.equal(layer.windows[0][:, :, :, :2], before.windows[0][:, :, :, :2])  # no sink entry written
    assert torch.equal(layer.windows[0][0, 1, :, 2 + 2 % 4], new_k[:, 0])


def test_bad_inputs():
    layer = Paged(2, 32, 32)
    rows = layer.plan(TS[:2], SLOTS[:2], TABLES[:2], [0, 1])
    new_k, new_v = _tokens(2, 2, 32, layer.dtype, 0)
    with pytest.raises(ValueError, match="new_k"):
        paged_append_reference(*layer.args(new_k[None], new_v[None], rows))
    with pytest.raises(ValueError, match="rows.slots"):
        paged_append_reference(*layer.args(new_k, new_v, dataclasses.replace(rows, slots=rows.slots.int())))
    args = list(layer.args(new_k, new_v, rows))
    args[7] = torch.tensor([0, 1, -1])
    with pytest.raises(ValueError, match="hist_heads"):
        paged_append_reference(*args)


# ------------------------------------------------------------------------------------- (b) Triton kernel (interpreter)


@interp
@pytest.mark.parametrize(
    "hk,d,g,heads,coded_bits,ring_extra,dtype,meta,quantizer",
    [
        (2, 64, 32, None, None, 0, torch.bfloat16, torch.bfloat16, "minmax"),
        (2, 64, 64, None, None, 2, torch.float16, torch.float16, "minmax"),
        (3, 64, 16, [1, -1, 0], 8, 0, torch.bfloat16, torch.float32, "minmax"),
        (3, 64, 32, [1, -1, 0], 16, 1, torch.bfloat16, torch.bfloat16, "std"),
        (2, 128, 128, [-1, 0], 16, 0, torch.float16, torch.float16, "minmax"),
        (3, 128, 32, [0, -1, 1], 8, 0, torch.bfloat16, torch.bfloat16, "minmax"),
        (2, 128, 64, None, None, 1, torch.float32, torch.bfloat16, "minmax"),
        (3, 64, 32, [-1, 0, -1], 4, 0, torch.float16, torch.float16, "minmax"),
        (2, 64, 32, [-1, -1], 8, 0, torch.bfloat16, torch.bfloat16, "minmax"),  # no INT2 head
    ],
)
@pytest.mark.parametrize("exact", [True, False])
def test_kernel_matches_reference(hk, d, g, heads, coded_bits, ring_extra, dtype, meta, quantizer, exact):
    ref = Paged(hk, d, g, heads=heads, coded_bits=coded_bits, dtype=dtype, meta=meta, exact=exact,
                ring_extra=ring_extra, mu=g != 64, seed=d + g)
    got, before = ref.clone(), ref.clone()
    rows = ref.plan(TS, SLOTS, TABLES, POS)
    new_k, new_v = _tokens(hk, 4, d, dtype, d)
    paged_append_reference(*ref.args(new_k, new_v, rows), quantizer=quantizer, **ref.coded())
    _triton()(*got.args(new_k, new_v, rows), quantizer=quantizer, **got.coded())
    assert_kernel_matches(got, ref, exact)
    assert _changed(before, got) > 0


@interp
def test_kernel_padded_rows_and_no_demotion():
    """A graphed step's padded rows (the trash slot, the trash page) change nothing else; a step with ``demote=False``
    writes no page at all, the trash page included."""
    ref = Paged(2, 64, 32, heads=[0, -1], coded_bits=8, seed=21)
    got = ref.clone()
    rows = ref.plan(TS, SLOTS, TABLES, POS, padded=3)
    new_k, new_v = _tokens(2, 7, 64, ref.dtype, 21)
    paged_append_reference(*ref.args(new_k, new_v, rows), **ref.coded())
    _triton()(*got.args(new_k, new_v, rows), **got.coded())
    assert_kernel_matches(got, ref, False, skip_trash=True)

    ref = Paged(2, 64, 32, heads=[0, -1], coded_bits=8, seed=22)
    got, before = ref.clone(), ref.clone()
    rows = ref.plan([1, 2], [0, 1], [[], []], [1, 0])
    new_k, new_v = _tokens(2, 2, 64, ref.dtype, 22)
    paged_append_reference(*ref.args(new_k, new_v, rows), demote=False, **ref.coded())
    _triton()(*got.args(new_k, new_v, rows), demote=False, **got.coded())
    assert_kernel_matches(got, ref, True)
    for a, b in zip((*got.pool.int2, *got.pool.coded), (*before.pool.int2, *before.pool.coded)):
        assert torch.equal(a, b)


@interp
def test_dispatch(monkeypatch):
    """use_kernels=True runs the kernel (interpreter); a head_dim the kernel does not take (80) goes to the reference;
    use_kernels=False is the reference."""
    import oscar_hf.kernels.append_triton as at

    launches = []
    real = at.paged_append_triton
    monkeypatch.setattr(at, "paged_append_triton",
                        lambda *a, **kw: (launches.append(a[1].shape[-1]), real(*a, **kw))[1])
    for d, g in ((64, 32), (80, 16)):
        ref = Paged(2, d, g, seed=d)
        got, off = ref.clone(), ref.clone()
        rows = ref.plan(TS, SLOTS, TABLES, POS)
        new_k, new_v = _tokens(2, 4, d, ref.dtype, d)
        paged_append_reference(*ref.args(new_k, new_v, rows))
        paged_append(*got.args(new_k, new_v, rows), use_kernels=True)
        paged_append(*off.args(new_k, new_v, rows), use_kernels=False)
        assert_kernel_matches(got, ref, False)
        assert_same(off, ref)
    assert launches == [64]


# ------------------------------------------------------------------------- (c) the store's decode step on the kernel


@interp
@pytest.mark.parametrize("kw", [{}, dict(retrieval_heads=((0, 1), (1, 0)), retrieval_bits=8),
                                dict(group_size=16, key_bits=3, value_group_size=32)])
def test_store_decode_write_on_the_kernel(monkeypatch, kw):
    """The serving store's decode steps with its write on the Triton kernel (the read on the reference) leave the same
    windows and pages as with the reference: the store hands the kernel its real views (the window pool at a layer,
    the pool's strided rows, the packed batch's keys). One write call per layer and step."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "serving"))
    import oscar_hf.serving.decode_step as st
    from test_store import FakeAttention, make_store

    from oscar_hf.kernels.write_path import append

    calls = []

    def on_kernel(*args, **kwargs):
        calls.append(1)
        return append(*args, **{**kwargs, "use_kernels": True})

    stores = []
    for kernel in (False, True):
        cfg, store = make_store(dtype=torch.bfloat16, **kw)
        if kernel:
            monkeypatch.setattr(st, "append", on_kernel)
        gen = torch.Generator().manual_seed(0)
        hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        lengths = {"a": 5, "b": 14, "c": 2}
        for step in range(8):
            batch = [(rid, 0 if step == 0 else n + step - 1, n if step == 0 else 1) for rid, n in lengths.items()]
            total = sum(q for _, _, q in batch)
            for layer in range(cfg.num_hidden_layers):
                q = torch.randn(1, hq, total, d, generator=gen).bfloat16()
                k, v = (torch.randn(1, total, hk, d, generator=gen).bfloat16().transpose(1, 2) for _ in "kv")
                store.attend(layer, q, k, v, batch, d**-0.5, FakeAttention(), "sdpa")
        stores.append(store)
    assert len(calls) == 7 * 2
    ref, got = stores
    assert torch.equal(ref.windows.k, got.windows.k) and torch.equal(ref.windows.v, got.windows.v)
    for a, b in zip(ref.pool.coded, got.pool.coded):
        assert torch.equal(a, b)
    for layer in range(ref.num_layers):  # every form of each layer's rows (3-bit keys: their high bits too)
        for kind in "kv":
            r, g_ = ref.pool.rows(layer, kind), got.pool.rows(layer, kind)
            for a, b in ((r.scale, g_.scale), (r.zero, g_.zero)):
                a, b = a.double(), b.double()
                assert ((a - b).abs() <= 1e-3 * b.abs().amax() + 2**-7 * b.abs()).all()
            cg, cr = (unpack_int2(x.codes).int() + (0 if x.hi is None else 4 * unpack_bits1(x.hi).int())
                      for x in (g_, r))
            assert (cg - cr).abs().max() <= 1 and ((cg != cr).double().mean() < 5e-3)
    assert ref.pool.num_used > 0  # the history did go to pages


# --------------------------------------------------------------------------------------------- (d) GPU, real shapes


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs CUDA (compiled kernels)")
@pytest.mark.parametrize("d,g", [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128), (96, 32), (512, 64)])
@pytest.mark.parametrize("coded_bits", [None, 8, 4, 16])
@pytest.mark.parametrize("quantizer", ["minmax", "std"])
def test_gpu_kernel_matches_reference(d, g, coded_bits, quantizer):
    hk, s0, w = 8, 4, 16
    heads = None if coded_bits is None else [0, 1, -1, 2, 3, 4, -1, 5]
    ts = [1, 3, s0 + w + 1, 40, 57, 100, 64 + s0 + w + 1, 300]  # sinks filling, first entries, page boundaries
    ref = Paged(hk, d, g, heads=heads, coded_bits=coded_bits, sink=s0, recent=w, slots=12, pages=40, page_size=16,
                seed=d + g, device="cuda")
    got = ref.clone()
    p, tables, used = ref.pool.page_size, [], 0
    for t in ts:  # each row its own pages, in reverse order (a block table is no range)
        n = -(-max(t - w - s0, 0) // p)
        tables.append(list(range(used + n - 1, used - 1, -1)))
        used += n
    rows = ref.plan(ts, [11, 0, 5, 3, 7, 1, 2, 9], tables, [7, 0, 1, 2, 3, 4, 5, 6], device="cuda", padded=4)
    new_k, new_v = _tokens(hk, 12, d, torch.bfloat16, d, "cuda")
    paged_append_reference(*ref.args(new_k, new_v, rows), quantizer=quantizer, **ref.coded())
    _triton()(*got.args(new_k, new_v, rows), quantizer=quantizer, **got.coded())
    torch.cuda.synchronize()
    assert_kernel_matches(got.to("cpu"), ref.to("cpu"), False, skip_trash=True)
