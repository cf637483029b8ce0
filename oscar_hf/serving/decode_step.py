"""The decode rows of one forward: planned on the host before it (:meth:`DecodeStep.plan_decode`, a :class:`StepPlan`
in fixed :class:`DecodeBuffers`), then one batched write and read per layer (:meth:`DecodeStep._decode`)."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from oscar_hf.kernels.decode import decode
from oscar_hf.kernels.kv import History, PagedRows, Pages, Window
from oscar_hf.kernels.write_path import append

from ..cache.base import group_queries
from ..cache.window import window_mask


@dataclasses.dataclass
class StepPlan:
    """What the decode rows of one forward read, shared by its layers: ``Bp`` rows (a graphed step's padded rows
    included) as views of the fixed :class:`DecodeBuffers`. Built on the host before the forward, which only reads it,
    so a replayed graph reads the next step's."""

    key: tuple  # the batch it was built for
    write: PagedRows  # [Bp] long each; a graphed step writes sink and demotes always (one graph serves every step)
    pages: Pages  # block_table [Bp, ceil(max_len / P)] int32 (-1 past a row's pages), lengths [Bp] int32 after the
    # demotion, max_len: the grid's bound (exact, or its bucket in a graphed step)
    win_mask: torch.Tensor  # [Bp, S0 + R] bool
    graphable: bool  # every tensor above is a view of the fixed buffers and the shapes depend on the bucket only
    requests: list  # [(request_id, T)] of the real rows, in row order


class DecodeBuffers:
    """The fixed device tensors a decode step reads, written by one copy each before the forward (so a captured graph
    replays with the next step's rows). ``rows`` x ``cols``: the most rows a step takes and pages a row spans."""

    FIELDS = ("pos", "slots", "new_entry", "sink_entry", "demote_entry", "demote_page", "demote_off", "t")

    def __init__(self, rows: int, cols: int, entries: int, device):
        self.rows, self.cols = rows, cols
        self.index = torch.zeros(len(self.FIELDS), rows, dtype=torch.long, device=device)  # [8, rows]
        self.table = torch.full((rows, cols), -1, dtype=torch.int32, device=device)
        self.hist_len = torch.zeros(rows, dtype=torch.int32, device=device)
        self.win_mask = torch.zeros(rows, entries, dtype=torch.bool, device=device)


def history_bucket(n: int, page_size: int) -> int:
    """A graphed step's history bound: ``n`` rounded up to a power of two of pages (about log2(pages) graphs a batch
    size, each within 2x of the longest history)."""
    if n <= 0:
        return 0
    pages = -(-n // page_size)
    return page_size * (1 << (pages - 1).bit_length())


class DecodeStep:
    """The batched decode rows of a forward (a base of :class:`~oscar_hf.serving.store.OscarPagedStore`)."""

    def plan_decode(self, batch, rows: int | None = None) -> StepPlan | None:
        """The decode rows' plan of the forward that packs ``batch`` (None: no decode row); pages are allocated and
        token counts advanced here, so the forward updates no host state. ``rows``: the padded row count of a step
        that may be graphed (padded rows: the trash slot and page)."""
        decode = [i for i, (_, past, q) in enumerate(batch) if q == 1 and past > 0]
        if not decode:
            self._plan = None
            return None
        self._need_pool()
        s0, w, ring, p = self.config.sink, self.config.recent, self.ring, self.pool.page_size
        trash_page = self.pool.trash_page
        graphed = (rows is not None and self.graph_rows > 0 and len(decode) == len(batch)
                   and len(decode) <= rows <= self.graph_rows and self.windows.trash_slot is not None)
        offsets = list(itertools.accumulate((q for _, _, q in batch), initial=0))  # each request's first row
        index_rows, tables, hist, requests = [], [], [], []  # index_rows: [Bp] tuples in DecodeBuffers.FIELDS order
        floors = []  # [Bp] window_mask's pad: a row's floor less S0 (its window's slots below the floor are not read)
        for i in decode:
            rid, t, _ = batch[i]
            r = self.requests.get(rid)
            if r is None or not r.lengths:  # never written: prefix sharing or an offload restore (_request refuses)
                self._request(rid, next(iter(self.layer_slot)), t, None)
            if any(n != t for n in r.lengths.values()):
                raise RuntimeError(f"request {rid!r}: the store holds {r.lengths} tokens per layer, the batch says {t}")
            # history entry of slot T - 1 - W, which left the window at the previous step; below the request's floor
            # it is in a shared prefix's pages already (prefix.SharedPrefixes._join_window): demoted to the trash page
            e = t - 1 - w - s0 if t - 1 - w >= r.floor else -1
            self._pages_for(r, e + 1)  # (none while e < 0)
            new_entry = s0 + t % ring
            index_rows.append((offsets[i], r.slot, new_entry, t if t < s0 else new_entry, s0 + (t - 1 - w) % ring,
                               r.table[e // p] if e >= 0 else trash_page, e % p if e >= 0 else 0, t))
            hist.append(max(t - w, r.floor, s0) - s0)  # (a joiner's pages below its floor even while T - W <= S0)
            floors.append(max(r.floor - s0, 0))
            tables.append(r.table)
            requests.append((rid, t))
        if graphed:  # the padded rows: the trash slot (t = -1: nothing valid in its window), the trash page
            for k in range(len(decode), rows):
                index_rows.append((k, self.windows.trash_slot, s0, s0, s0, trash_page, 0, -1))
                hist.append(0)
                tables.append([])
                floors.append(0)
        max_hist = history_bucket(max(hist), p) if graphed else max(hist)
        cols = max(1, -(-max_hist // p))
        bp = len(index_rows)
        # on the host, through numpy (3x faster than torch.tensor from lists: ~80 us for 24 rows x 128 pages)
        index = torch.from_numpy(np.array(index_rows, dtype=np.int64).T)  # [8, Bp]
        # [Bp, cols] block tables, -1 past a row's pages
        table = torch.from_numpy(np.array([tb[:cols] + [-1] * (cols - min(len(tb), cols)) for tb in tables],
                                          dtype=np.int32))
        if self._buffers is None:  # allocated once: every window slot (or graphed row), the longest history's pages
            most = self.pool.num_pages
            if self.max_positions:
                most = min(most, max(1, self.history_pages(self.max_positions, p)))
            self._buffers = DecodeBuffers(max(self.windows.num_slots, self.graph_rows), most, s0 + ring, self.device)
        buf = self._buffers
        if bp > buf.rows or cols > buf.cols:  # outgrew the buffers: fresh tensors, eagerly
            graphed = False
            buf = DecodeBuffers(bp, cols, s0 + ring, self.device)
        # the window mask: the new token, the W before it and the sink; computed on the host: every write here is a
        # synchronous copy, complete before the forward starts on Transformers' compute stream (a device op would race)
        wm = buf.win_mask[:bp].copy_(window_mask(index[7] + 1, torch.tensor(floors), s0, ring, w + 1))
        ts = [t for _, t in requests]
        # the index rows in FIELDS order: pos, slots, new_entry, sink_entry, demote_entry, demote_page, demote_off
        write = PagedRows(*buf.index[:, :bp].copy_(index)[:7], demote=graphed or max(ts) > w + s0,
                          write_sink=graphed or min(ts) < s0)
        pages = Pages(buf.table[:bp, :cols].copy_(table),
                      buf.hist_len[:bp].copy_(torch.tensor(hist, dtype=torch.int32)), max_hist)
        self._plan = StepPlan(tuple(batch), write, pages, wm, graphed, requests)
        for rid, t in requests:  # the step's writes are planned: every layer holds T + 1 tokens after the forward
            r = self.requests[rid]
            r.lengths = dict.fromkeys(r.lengths, t + 1)
            r.prompt.clear()  # decoding: the prompt is complete, its full-precision chunks go
            r.prompt_reserved = 0
        return self._plan

    def _decode(self, layer_idx: int, plan: StepPlan, query, new_k, new_v, scaling: float) -> torch.Tensor:
        """``[Bp, Hq, D]``: write then read one token for each row of ``plan``; device work only (graph-capturable)."""
        li, p, pool = self.layer_slot[layer_idx], self.params[layer_idx], self.pool
        params = self.kv_params[layer_idx]
        # the window pool [slots, Hk, S0 + R, D] (row b at slot plan.write.slots[b]); the pages through the block tables
        window = Window(self.windows.k[:, li], self.windows.v[:, li], plan.win_mask[:, None, None, :],
                        plan.write.slots)
        coded = (pool.coded_rows(li, "k"), pool.coded_rows(li, "v")) if p.coded_heads else None
        history = History(pool.rows(li, "k"), pool.rows(li, "v"), pages=plan.pages, coded=coded)
        # 1-2. the write: slot T - 1 - W into the pages, the new token into the ring (and the sink)
        append(params, new_k[0], new_v[0], window, history, plan.write, use_kernels=self.config.use_kernels)
        # 3. the read: history pages + the window slots
        pos = plan.write.pos
        q = group_queries(query[0].index_select(1, pos).transpose(0, 1)[:, :, None], self.num_kv_heads)
        out = decode(params, q, window, history, scaling, query.dtype, use_kernels=self.config.use_kernels)
        return out.reshape(pos.shape[0], query.shape[1], query.shape[3])
