"""The INT2 page pool: allocation accounting, sharing, and writes/reads through a block table."""
import pytest
import torch

from oscar_hf.cache.base import group_queries, mask_rows
from oscar_hf.kernels.int2_attention import decode_attention_reference, rotate_query_reference
from oscar_hf.kernels.kv import History, KVParams, Pages, Window
from oscar_hf.kernels.paged_decode import paged_multi_token_attention
from oscar_hf.quant import QuantizedRows, encode_heads
from oscar_hf.serving import PagedInt2Pool, PoolExhausted, page_bytes
from oscar_hf.serving.paged_attention import paged_chunk_attention
from oscar_hf.serving.pool import HeadLayout


def paged_history(pool, table, layer, n):
    """One request's history in ``pool`` (block table ``table``, ``n`` entries) as the chunk read takes it."""
    dev = pool.codes.device
    return History(pool.rows(layer, "k"), pool.rows(layer, "v"),
                   pages=Pages(torch.tensor([table], device=dev), torch.tensor([n], device=dev), n))


def small_pool(num_pages=6, page_size=4, layers=2, hk=2, d=32, g=16):
    return PagedInt2Pool(num_pages, layers, hk, d, page_size, g, torch.float32)


def test_allocate_release_accounting():
    pool = small_pool()
    pages = [pool.allocate() for _ in range(6)]
    assert sorted(pages) == list(range(6)) and pool.num_free == 0 and pool.peak_used == 6
    with pytest.raises(PoolExhausted):
        pool.allocate()
    pool.acquire(pages[0])  # shared by a second holder
    pool.release(pages[0])
    assert pool.num_free == 0  # still held once
    for p in pages:
        pool.release(p)
    assert pool.num_free == 6 and pool.num_used == 0
    with pytest.raises(ValueError):
        pool.release(pages[1])
    with pytest.raises(ValueError):
        pool.acquire(pages[1])


def test_page_bytes_and_bad_sizes():
    pool = small_pool()
    # codes D/4 + scale and zero D/G each (float32), keys and values, 2 layers, 2 heads, 4 tokens
    assert pool.bytes_per_page == 2 * 2 * 2 * 4 * (32 // 4 + 2 * 2 * 4) == page_bytes(2, 2, 32, 4, 16, torch.float32)
    assert pool.nbytes == 6 * pool.bytes_per_page
    with pytest.raises(ValueError):
        PagedInt2Pool(0, 1, 1, 32, 4, 16)
    with pytest.raises(ValueError):
        PagedInt2Pool(4, 1, 1, 32, 4, 12)  # group size does not divide head_dim


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("in_storage", [False, True])
def test_layers_with_retrieval_heads(bits, in_storage):
    """Layers keep different heads in INT2 (3 layers of 2 KV heads: 2, 1 and 0 of them) and the rest as coded rows
    (encode_heads) in the same pages: each layer's rows are views of its own heads, written and read back through a
    block table, and a page costs exactly its rows (also laid out in a flat uint8 storage, widest dtype first)."""
    from oscar_hf.cache import heads

    num_pages, hk, d, p, g, dt = 6, 2, 32, 4, 16, torch.bfloat16
    layout = HeadLayout(int2_heads=(2, 1, 0), coded_heads=(0, 1, 2), coded_bits=bits, coded_dtype=dt)
    size = page_bytes(3, hk, d, p, g, torch.float32, layout)
    int2_row, coded_row = d // 4 + 2 * (d // g) * 4, heads.row_bytes(bits, d, dt)
    assert size == 2 * p * (3 * int2_row + 3 * coded_row)
    storage = torch.zeros(num_pages * size + 2, dtype=torch.uint8)[1:-1] if in_storage else None
    if in_storage:
        with pytest.raises(ValueError, match="aligned"):  # an odd start address
            PagedInt2Pool(num_pages, 3, hk, d, p, g, torch.float32, storage=storage, layout=layout)
        storage = torch.zeros(num_pages * size, dtype=torch.uint8)
    pool = PagedInt2Pool(num_pages, 3, hk, d, p, g, torch.float32, storage=storage, layout=layout)
    assert pool.bytes_per_page == size and pool.nbytes == num_pages * size
    assert pool.coded_bytes_per_page == 2 * p * 3 * coded_row
    if in_storage:  # views of the storage, no memory of their own
        assert all(t.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
                   for t in (*pool.int2, *pool.coded))
    table = [5, 0, 2]
    gen = torch.Generator().manual_seed(4)
    written = {}
    for layer, (hq, f) in enumerate(zip(layout.int2_heads, layout.coded_heads)):
        assert pool.rows(layer, "k").codes.shape == (num_pages, hq, p, d // 4)
        for kind in "kv":
            if hq:
                rows = random_rows(10, hk=hq, d=d, g=g, seed=layer)
                pool.write(table, layer, kind, 0, rows)
                written[layer, kind, "int2"] = rows
            if f:
                parts = encode_heads(torch.randn(1, f, 10, d, generator=gen).to(dt), bits)  # [1, F_l, 10, *]
                pool.write_coded(table, layer, kind, 0, parts)
                written[layer, kind, "coded"] = parts
    for (layer, kind, form), want in written.items():  # every layer's rows intact after the others were written
        if form == "int2":
            got = pool.gather(torch.tensor(table), layer, kind, 10)
        else:
            got = pool.gather_coded(torch.tensor([table, table]), layer, kind, 10)  # two rows with the same pages
            assert all(a.shape[0] == 2 for a in got)
            got = tuple(a[:1] for a in got)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="one count per layer"):
        PagedInt2Pool(4, 2, hk, d, p, g, layout=HeadLayout((2, 2), (0, 1)))  # 3 heads in a layer of 2
    with pytest.raises(ValueError, match="one count per layer"):
        PagedInt2Pool(4, 2, hk, d, p, g, layout=HeadLayout((2,)))


def random_rows(n, hk=2, d=32, g=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return QuantizedRows(torch.randint(0, 256, (1, hk, n, d // 4), dtype=torch.uint8, generator=gen),
                         torch.rand(1, hk, n, d // g, generator=gen), torch.randn(1, hk, n, d // g, generator=gen))


@pytest.mark.parametrize("in_storage", [False, True])
def test_key_bits_and_value_groups_are_laid_out_and_paid_for(in_storage):
    """3-bit keys (their high bits a pool tensor of their own) and the values at a group of their own (their scale and
    zero too), beside a retrieval head: each layer's keys read back as QuantizedRows3 and its values at their group,
    every page tensor counted in the page's bytes, and a page copy copies them all."""
    from oscar_hf.cache import heads
    from oscar_hf.quant import QuantizedRows3, pack_bits1

    num_pages, hk, d, p, g, gv, meta = 5, 2, 32, 4, 8, 16, torch.bfloat16
    layout = HeadLayout(int2_heads=(2, 1), coded_heads=(0, 1), coded_bits=8, key_bits=3, value_group=gv)
    size = page_bytes(2, hk, d, p, g, meta, layout)
    key_row, value_row = d // 4 + d // 8 + 2 * (d // g) * 2, d // 4 + 2 * (d // gv) * 2
    assert size == p * (3 * (key_row + value_row) + 2 * heads.row_bytes(8, d, torch.bfloat16))
    assert size - page_bytes(2, hk, d, p, g, meta, HeadLayout((2, 1), (0, 1), 8, value_group=gv)) == p * 3 * d // 8
    storage = torch.zeros(num_pages * size, dtype=torch.uint8) if in_storage else None
    pool = PagedInt2Pool(num_pages, 2, hk, d, p, g, meta, storage=storage, layout=layout)
    assert pool.nbytes == num_pages * size == sum(t.numel() * t.element_size() for t in pool.tensors)
    assert len(pool.tensors) == 3 + 2 + 1 + 3  # codes, the keys' scale / zero, the values', high bits, coded parts
    gen = torch.Generator().manual_seed(9)
    table, written = [3, 0, 4], {}
    for layer, hq in enumerate(layout.int2_heads):
        for kind in "kv":
            group = g if kind == "k" else gv
            rows = QuantizedRows(torch.randint(0, 256, (1, hq, 10, d // 4), dtype=torch.uint8, generator=gen),
                                 torch.rand(1, hq, 10, d // group, generator=gen).to(meta),
                                 torch.randn(1, hq, 10, d // group, generator=gen).to(meta))
            if kind == "k":
                rows = QuantizedRows3(*rows, pack_bits1(torch.randint(0, 2, (1, hq, 10, d), generator=gen)))
                with pytest.raises(ValueError, match="QuantizedRows3"):  # INT2 rows where 3-bit keys live
                    pool.write(table, layer, kind, 0, QuantizedRows(*rows[:3]))
            pool.write(table, layer, kind, 0, rows)
            written[layer, kind] = rows
    for (layer, kind), want in written.items():  # every layer's rows intact after the others were written
        got = pool.gather(torch.tensor(table), layer, kind, 10)
        assert type(got) is type(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    pool.copy_page(3, 1)
    assert all(torch.equal(t[1], t[3]) for t in pool.tensors)
    with pytest.raises(ValueError, match="key_bits"):
        PagedInt2Pool(4, 1, 1, 32, 4, 16, layout=HeadLayout(key_bits=4))
    with pytest.raises(ValueError, match="group_size=12"):
        PagedInt2Pool(4, 1, 1, 32, 4, 16, layout=HeadLayout(value_group=12))


def test_write_gather_roundtrip_across_pages():
    pool = small_pool()
    table = [4, 1, 3]  # not in order: the block table decides where entry j lives
    rows = random_rows(10)
    pool.write(table, 1, "k", 0, QuantizedRows(*(t[:, :, :3] for t in rows)))  # a prefill chunk, then single rows
    for j in range(3, 10):
        pool.write(table, 1, "k", j, QuantizedRows(*(t[:, :, j : j + 1] for t in rows)))
    got = pool.gather(torch.tensor(table), 1, "k", 10)
    for a, b in zip(got, rows):
        assert torch.equal(a, b)
    assert not pool.codes[:, 0].any() and not pool.codes[:, 1, 1].any()  # other layer and the values untouched


def test_paged_read_equals_contiguous_reference():
    """Reading the history through a shuffled block table gives the contiguous reference's result bit for bit."""
    torch.manual_seed(0)
    hk, d, g, m, n, p = 2, 32, 16, 3, 37, 4
    pool = PagedInt2Pool(12, 1, hk, d, p, g, torch.float32)
    table = [pool.allocate() for _ in range(10)][::-1]
    k, v = random_rows(n, seed=1), random_rows(n, seed=2)
    pool.write(table, 0, "k", 0, k)
    pool.write(table, 0, "v", 0, v)
    qf = torch.randn(1, hk, m, d)
    r_k = torch.linalg.qr(torch.randn(hk, d, d))[0]
    r_v = torch.linalg.qr(torch.randn(hk, d, d))[0]
    mu_k, mu_v = torch.randn(hk, d), torch.randn(hk, d)
    win_k, win_v = torch.randn(1, hk, 5, d), torch.randn(1, hk, 5, d)
    for block_n in (8, 1024):
        got = paged_multi_token_attention(KVParams(r_k, mu_k, r_v, mu_v, g, block_n=block_n), qf,
                                          Window(win_k, win_v), paged_history(pool, table, 0, n), 0.2, torch.float32)
        q_rot, off = rotate_query_reference(qf, r_k, mu_k)
        want = decode_attention_reference(KVParams(r_k, mu_k, r_v, mu_v, g, block_n=block_n), qf,
                                          Window(win_k, win_v), History(k, v, torch.zeros(1, dtype=torch.long)), 0.2,
                                          torch.float32, rotated=(q_rot, off))
        assert torch.equal(got, want)


CHUNK_CASES = [("cpu", torch.float32, 1e-4, 1e-5)]
if torch.cuda.is_available():  # the GPU's SDPA kernels (memory-efficient with the lower-right causal mask), BF16
    CHUNK_CASES.append(pytest.param("cuda", torch.bfloat16, 2e-2, 2e-2, marks=pytest.mark.gpu))  # run_gpu.sh tests


@pytest.mark.parametrize("device,dtype,rtol,atol", CHUNK_CASES)
@pytest.mark.parametrize("n,sliced", [(0, False), (1, False), (37, False), (37, True)])
def test_chunk_attention_equals_reference(monkeypatch, n, sliced, device, dtype, rtol, atol):
    """A chunk of new rows after earlier tokens (the store's path: the history read in place, merged with the window
    and the new rows, a slice of rows at a time when their window logits would pass the budget) equals the float32
    reference that reads the history block by block, with the new rows causal among themselves; with no history yet
    it is exact attention over the window and the new rows."""
    torch.manual_seed(3)
    hk, g, d, gs, p, e, l = 2, 3, 32, 16, 4, 6, 5
    if sliced:  # two rows a slice
        monkeypatch.setattr("oscar_hf.serving.paged_attention.LOGITS_BUDGET", 4 * hk * g * (e + l) * 2)
    pool = PagedInt2Pool(12, 1, hk, d, p, gs, torch.float32, device=device)
    table = [pool.allocate() for _ in range(10)][::-1]
    if n:
        for kind, seed in (("k", 1), ("v", 2)):
            pool.write(table, 0, kind, 0, QuantizedRows(*(t.to(device) for t in random_rows(n, seed=seed))))
    r_k, r_v = (torch.linalg.qr(torch.randn(hk, d, d))[0].to(device) for _ in range(2))
    mu_k, mu_v = torch.randn(hk, d, device=device), torch.randn(hk, d, device=device)
    query = torch.randn(1, hk * g, l, d).to(device, dtype)
    k_win, v_win = torch.randn(1, hk, e + l, d).to(device, dtype), torch.randn(1, hk, e + l, d).to(device, dtype)
    got = paged_chunk_attention(query, Window(k_win, v_win), pool, table, 0, n, KVParams(r_k, mu_k, r_v, mu_v, gs),
                                0.2)  # [1, L, Hq, D]
    assert got.dtype == dtype
    query, k_win, v_win = query.float(), k_win.float(), v_win.float()
    visible = torch.arange(e + l, device=device)[None, :] <= e + torch.arange(l, device=device)[:, None]  # [L, E+L]
    if n:
        want = paged_multi_token_attention(KVParams(r_k, mu_k, r_v, mu_v, gs), group_queries(query, hk),
                                           Window(k_win, v_win, mask_rows(visible[None], g)),
                                           paged_history(pool, table, 0, n), 0.2, torch.float32, use_kernels=False)
        want = want.reshape(1, hk * g, l, d)
    else:
        want = torch.nn.functional.scaled_dot_product_attention(
            query, k_win.repeat_interleave(g, 1), v_win.repeat_interleave(g, 1), attn_mask=visible, scale=0.2)
    torch.testing.assert_close(got.float(), want.transpose(1, 2), rtol=rtol, atol=atol)


def test_kept_makes_a_tensor_once_per_key_and_keeps_the_latest():
    """``PagedInt2Pool.kept`` (the tensors every layer of a forward asks for alike): one ``make`` per key while kept,
    the oldest key dropped past ``IDS_KEPT``, ``ids`` through it (values and dtype in the key); a released pool forgets."""
    from oscar_hf.serving.pool import IDS_KEPT

    pool, made = small_pool(), []
    first = pool.kept(("k", 0), lambda dev: made.append(0) or torch.zeros(2, device=dev))
    assert pool.kept(("k", 0), lambda dev: made.append(1) or torch.ones(2)) is first and made == [0]
    assert pool.ids([3, 1], torch.int32).tolist() == [3, 1] and pool.ids([3, 1], torch.long).dtype == torch.long
    assert pool.ids([3, 1], torch.int32) is pool.ids([3, 1], torch.int32)
    for i in range(IDS_KEPT):  # the first key is the oldest: dropped
        pool.kept(("fill", i), lambda dev: torch.empty(0))
    again = pool.kept(("k", 0), lambda dev: made.append(2) or torch.zeros(2))
    assert again is not first and made == [0, 2]
    pool.release_storage()
    assert pool.kept(("k", 0), lambda dev: made.append(3) or torch.zeros(2)) is not again and made[-1] == 3
