"""Compile the read kernels' variants before a server takes requests (:func:`warm_kernels`).

Triton compiles a kernel variant the first time a launch needs it: a new query-row tile (``M_PAD``), a combine tile
(``S_BLOCK`` from the split count), window tiles, the Gluon path from a history length on. In serving those follow
the traffic (chunk lengths, histories, batch sizes), so each first meeting compiled inside a served step and stalled
every request of it for 0.3-2 s (``serving_prefix_*_trace`` in docs/serving.md). The warm-up runs the store's two
reads, the chunk read (:func:`~oscar_hf.serving.paged_attention.paged_chunk_attention`) and the batched decode read
(:func:`~oscar_hf.kernels.decode.decode`), over a grid of the shapes a configuration can meet, on zeros in a scratch
page and window slot laid out as the store's (the kernels' specialization sees the same strides): nothing of the
store is read or written. On a fresh machine it compiles; later starts load the variants from Triton's disk cache.
"""
from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from oscar_hf.kernels.decode import decode
from oscar_hf.kernels.kv import History, Pages, Window
from oscar_hf.kernels.paged_decode import LOGITS_BUDGET
from oscar_hf.kernels.settings import triton_enabled

from ..cache.base import group_queries
from .paged_attention import paged_chunk_attention
from .pool import PagedInt2Pool

PER_OCTAVE = 4  # grid points per doubling of a length (the plans' tiles change at powers of two and at thresholds)
# decode rows taken one by one up to here: the split count follows the rows closely (the wave model's splits per row
# shrink with every row added), and with it the combine's tile (H100 trace: 4 rows a doubling missed two variants)
DENSE_ROWS = 128
_WARMED: dict[tuple, dict] = {}  # warm_once: what this process has warmed, and what it took


def length_grid(hi: int, per_octave: int = PER_OCTAVE) -> list[int]:
    """Lengths ``1 .. hi``: every power of two, ``per_octave`` points in each doubling, and ``hi``."""
    if hi < 1:
        return []
    out = {hi}
    for k in range(hi.bit_length()):
        out.update(min(hi, (1 << k) + ((1 << k) * j) // per_octave) for j in range(per_octave))
    return sorted(out)


def one_part(num_query_heads: int, entries: int) -> int:
    """The longest chunk :func:`paged_chunk_attention` reads in one part after ``entries`` window entries (its window
    logits ``[Hq, L, E + L]`` float32 within ``LOGITS_BUDGET``); at least 1."""
    fits = lambda l: LOGITS_BUDGET // (4 * num_query_heads * (entries + l)) >= l  # noqa: E731
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def kernels_used(store) -> bool:
    """Whether the store's reads run the Triton kernels (``triton_enabled`` for a tensor on its device)."""
    return triton_enabled(torch.empty(0, device=store.device), store.config.use_kernels)


def _layer_kinds(store) -> dict[tuple, int]:
    """``{(retrieval heads, group size): the first model layer of that kind}``: the layers whose reads launch the
    same kernel variants."""
    kinds = {}
    for layer, p in store.params.items():
        kinds.setdefault((tuple(p.coded_heads), store.kv_params[layer].group_size), layer)
    return kinds


def warm_kernels(store, *, page_size: int | None = None, max_chunk: int | None = None, max_rows: int | None = None,
                 max_history: int | None = None, per_octave: int = PER_OCTAVE, progress: bool = True) -> dict:
    """Run ``store``'s reads once for every shape of the grid: chunk reads of ``1 .. max_chunk`` rows (the
    manager's ``max_batch_tokens``; default: the store's ``prompt_budget``; a longer chunk is read in parts,
    :func:`one_part`) and decode reads of ``1 .. max_rows`` rows (default: its window slots, or its graphed rows;
    every count up to ``DENSE_ROWS``), each over histories of ``1 .. max_history`` tokens (default: the model's
    ``max_position_embeddings``). One layer of each kind (retrieval heads or not) stands for its kind. ``page_size``:
    the pool's (default: the attached pool's; required before it). Returns ``{"calls", "seconds"}``; nothing runs
    where the reads do not use the kernels (:func:`kernels_used`)."""
    if not kernels_used(store):
        return dict(calls=0, seconds=0.0)
    if page_size is None:
        if store.pool is None:
            raise ValueError("warm_kernels before the store has its pool: give page_size= (the pool's page size)")
        page_size = store.pool.page_size
    max_chunk = max_chunk or store.prompt_budget
    max_rows = max_rows or max(store.windows.num_slots, store.graph_rows)
    max_history = max_history or store.max_positions
    if not max_history:
        raise ValueError("the model config has no max_position_embeddings: give max_history= (the longest history)")
    for name, value in (("page_size", page_size), ("max_chunk", max_chunk), ("max_rows", max_rows),
                        ("max_history", max_history)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    t0 = time.perf_counter()
    dev, dt = store.device, store.dtype
    entries = store.config.sink + store.ring
    # one scratch page (every table entry names it) and one window slot, laid out as the store's
    pool = PagedInt2Pool(1, store.num_layers, store.num_kv_heads, store.head_dim, page_size, store.config.group_size,
                         store.config.torch_meta_dtype, dev, layout=store._layout())
    slot_k = torch.zeros((1, *store.windows.slot_shape), dtype=dt, device=dev)  # [1, L, Hk, S0 + R + 1, D]
    kinds = _layer_kinds(store)
    histories = length_grid(max_history, per_octave)
    # a chunk is read in parts of at most one_part(...) rows, so longer ones only repeat shorter ones' launches
    chunks = length_grid(min(max_chunk, one_part(store.num_query_heads, entries - 1)), per_octave)
    rows = sorted(set(range(1, min(max_rows, DENSE_ROWS) + 1)) | set(length_grid(max_rows, 4 * per_octave)))
    calls = 0
    with torch.no_grad(), tqdm(total=len(kinds) * len(histories) * (len(chunks) + len(rows)),
                               desc="OSCAR kernel warm-up", disable=not progress, mininterval=5) as bar:
        for layer in kinds.values():
            for n in histories:
                for l in chunks:
                    _chunk_read(store, layer, pool, page_size, l, entries - 1, n)
                    bar.update(1)
                for b in rows:
                    _decode_read(store, layer, pool, slot_k, b, n)
                    bar.update(1)
                calls += len(chunks) + len(rows)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return dict(calls=calls, seconds=round(time.perf_counter() - t0, 3))


def _chunk_read(store, layer: int, pool: PagedInt2Pool, page_size: int, l: int, e: int, n: int) -> None:
    """:meth:`OscarPagedStore._attend_one`'s read: ``l`` new rows after ``e`` window entries over ``n`` history
    entries (the query ``[1, Hq, L, D]`` a view of the packed ``[1, Q, Hq, D]``, as the forward passes it)."""
    hq, hk, d = store.num_query_heads, store.num_kv_heads, store.head_dim
    query = torch.zeros(1, l, hq, d, dtype=store.dtype, device=store.device).transpose(1, 2)
    k_win = torch.zeros(1, hk, e + l, d, dtype=store.dtype, device=store.device)
    paged_chunk_attention(query, Window(k_win, k_win), pool, [0] * math.ceil(n / page_size),
                          store.layer_slot[layer], n, store.kv_params[layer], d**-0.5, store.config.use_kernels)


def _decode_read(store, layer: int, pool: PagedInt2Pool, slot_k: torch.Tensor, b: int, n: int) -> None:
    """:meth:`DecodeStep._decode`'s read: ``b`` rows over ``n`` history entries each and their window slots."""
    hq, hk, d = store.num_query_heads, store.num_kv_heads, store.head_dim
    li, dev = store.layer_slot[layer], store.device
    cols = math.ceil(n / pool.page_size)
    # as the step plan's views of its fixed buffers: [B, S0 + R + 1] mask, [B, cols] block table, [B] lengths
    mask = torch.ones(b, slot_k.shape[3], dtype=torch.bool, device=dev)
    window = Window(slot_k[:, li], slot_k[:, li], mask[:, None, None, :], torch.zeros(b, dtype=torch.long, device=dev))
    pages = Pages(torch.zeros(b, cols, dtype=torch.int32, device=dev), torch.full((b,), n, dtype=torch.int32,
                                                                                  device=dev), n)
    coded = (pool.coded_rows(li, "k"), pool.coded_rows(li, "v")) if store.params[layer].coded_heads else None
    history = History(pool.rows(li, "k"), pool.rows(li, "v"), pages=pages, coded=coded)
    # the packed query's decode rows, [Hq, B, D] gathered then [B, Hq, 1, D], grouped by KV head
    q = group_queries(torch.zeros(hq, b, d, dtype=store.dtype, device=dev).transpose(0, 1)[:, :, None], hk)
    decode(store.kv_params[layer], q, window, history, d**-0.5, store.dtype, use_kernels=store.config.use_kernels)


def warm_once(store, **bounds) -> dict:
    """:func:`warm_kernels` unless this process has warmed a store of the same shapes and bounds (a model's next
    manager, a model switch back): the compiled variants are the kernels' own, not the store's."""
    if not kernels_used(store):
        return dict(calls=0, seconds=0.0)
    key = (store.device, store.dtype, store.num_query_heads, store.num_kv_heads, store.head_dim, store.config.sink,
           store.config.recent, store.config.use_kernels, tuple(sorted(_layer_kinds(store))),
           store.pool.page_size if store.pool else None, store.windows.num_slots, store.graph_rows, tuple(sorted(bounds.items())))
    if key not in _WARMED:
        _WARMED[key] = warm_kernels(store, **bounds)
    return _WARMED[key]
