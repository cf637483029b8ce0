"""Read path of the paged store for one request's rows when they continue a request (a prompt chunk after earlier
tokens): the INT2 history is read through the request's block table.

:func:`paged_chunk_attention` is the path the store takes: one scaled-dot-product attention call in the rotated
space over ``[history | window | new rows]``, the history dequantized once for the call (one request and one layer,
freed when the call returns; decode rows never do this). A continuing chunk can be a whole long prompt: Transformers'
scheduler fills a step's token budget with the first few tokens of the next prompt and sends the rest next step, so
this path carries prefill-sized work and has to run at SDPA speed.

:func:`paged_multi_token_attention` is its float32 reference and is :func:`oscar_hf.kernels.int2_attention.decode_attention_reference` with the
contiguous history replaced by pages: the history partial is accumulated over blocks of ``block_n`` entries, each
block gathered from its pages (:meth:`PagedInt2Pool.gather`: packed INT2 codes + metadata, never full precision)
and dequantized by :func:`history_partial_reference`, the blocks merged by the online-softmax rule. With ``block_n``
a multiple of the page size the blocks are the ones the contiguous reference reads, so the result is the same as
:class:`~oscar_hf.cache.dynamic.OscarLayer`'s. The decode rows of a batch (one token each) take the split-K kernel
instead, which loads each split's pages through the block tables
(:func:`oscar_hf.kernels.decode.decode`).

Shapes: ``Hk`` KV heads, ``M = g * L`` query rows per KV head (query-head-major), ``D`` head_dim, ``n`` history
entries of the request, ``P`` the page size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from oscar_hf.kernels.int2_attention import (empty_partial, history_partial_reference, merge_history_and_window,
                                               merge_partials, rotate_query_reference)
from oscar_hf.kernels.kv import KVParams, Window

from ..attention import OscarKV
from ..cache import heads
from ..cache.base import group_queries
from ..cache.params import LayerParams
from ..quant import dequantize_rows
from .pool import PagedInt2Pool

LOGITS_BUDGET = 256 << 20  # bytes of one history block's logits


def paged_history_partial(q_rot, pool: PagedInt2Pool, table: list[int], layer: int, n: int, qk_offset, scaling: float,
                          block_n: int):
    """``(m, l, acc)`` of ``q_rot [1, Hk, M, D]`` (rotated, float32) over history entries ``[0, n)`` of the request
    with block table ``table``, ``block_n`` entries at a time (rounded up to whole pages)."""
    p = pool.page_size
    # a block's logits are [Hk, M, block] float32: a long prompt chunk (M = g * L rows) reads fewer entries at a time
    hk, m = q_rot.shape[1], q_rot.shape[2]
    block_n = min(block_n, LOGITS_BUDGET // (4 * hk * m))
    block = max(p, block_n // p * p)
    part = empty_partial(q_rot)
    start = torch.zeros(1, dtype=torch.long, device=q_rot.device)
    for j0 in range(0, n, block):
        j1 = min(n, j0 + block)
        pages = torch.tensor(table[j0 // p : (j1 + p - 1) // p], dtype=torch.long, device=pool.codes.device)
        k = pool.gather(pages, layer, "k", j1 - j0)
        v = pool.gather(pages, layer, "v", j1 - j0)
        blk = history_partial_reference(q_rot, k, v, start, None, qk_offset, scaling, pool.group_size, block_n=block)
        part = merge_partials([part, blk])
    return part


def paged_multi_token_attention(params: KVParams, qf, window: Window, pool: PagedInt2Pool, table: list[int],
                                layer: int, n: int, scaling: float, out_dtype) -> torch.Tensor:
    """``[1, Hk, M, D]``: attention of the unrotated query ``qf [1, Hk, M, D]`` over the request's INT2 history
    (``n`` entries through ``table``, ``params.block_n`` at a time) and its full-precision window ``window.k/v [1, Hk,
    W, D]`` (``window.mask`` None or bool broadcastable to ``[1, Hk, M, W]``). The history partial is computed in the
    rotated space (``q R_K``, ``+ q·mu_K``), brought back by ``R_Vᵀ`` and ``+ l·mu_V``, merged with the window by
    log-sum-exp."""
    q_rot, qk_offset = rotate_query_reference(qf, params.r_k, params.mu_k)
    hist = paged_history_partial(q_rot, pool, table, layer, n, qk_offset, scaling, params.block_n)
    return merge_history_and_window(hist, qf, window.k, window.v, window.mask, params.r_v, params.mu_v, scaling,
                                    out_dtype)


def paged_chunk_attention(query, window: Window, pool: PagedInt2Pool, table: list[int], layer: int, n: int, r_k,
                          mu_k, r_v, mu_v, scaling: float, split: LayerParams | None = None) -> torch.Tensor:
    """``[1, L, Hq, D]``: the ``L`` new rows ``query [1, Hq, L, D]`` of one request over its history (``n`` entries
    through ``table``), then its window and new rows ``window.k/v [1, Hk, E + L, D]`` (the last ``L`` are the new
    rows, causal among themselves; everything before them is visible to every row; ``window.mask`` unused).

    In the INT2 history's space: keys ``(k - mu_K) R_K``, values ``(v - mu_V) R_V``, query ``q R_K``. The window is
    brought into that space exactly (``R`` is orthogonal), so one SDPA call covers all keys; the logit offset
    ``q · mu_K`` is the same for every key of a row, which softmax ignores; the output comes back by ``R_Vᵀ`` and
    ``+ mu_V`` (the weights sum to one). With ``split`` (a layer with retrieval heads; ``r_*``, ``mu_*`` then of its
    ``split.int2_heads``) the coded heads read their coded history (dequantized, :mod:`oscar_hf.cache.heads`) and
    their window unrotated, in the same SDPA call. With ``n == 0`` nothing is rotated: exact attention."""
    _, hq, l, d = query.shape
    k_win, v_win = window.k, window.v
    hk, dt = k_win.shape[1], query.dtype
    keys, values, q = k_win, v_win, query
    int2 = split.int2_idx if split is not None else None
    if n:
        pages = torch.tensor(table[: -(-n // pool.page_size)], dtype=torch.long, device=pool.int2.codes.device)

        def rotated(x, r, mu):  # [1, Hq_l, E + L, D] -> (x - mu) R, float32
            x = x.float() if mu is None else x.float() - mu.float()[None, :, None]
            return torch.matmul(x, r.float().unsqueeze(0))

        def history_space(kind, win, r, mu):  # [1, Hk, n + E + L, D]: each head's keys (values) as its history reads
            if split is not None and not split.int2_heads:
                part = None
            else:
                part = torch.cat([dequantize_rows(pool.gather(pages, layer, kind, n), pool.group_size),
                                  rotated(win if int2 is None else win.index_select(1, int2), r, mu)], 2).to(dt)
            if split is None:
                return part
            coded = heads.decode(pool.gather_coded(pages[None], layer, kind, n), split.bits, dt)  # [1, F_l, n, D]
            return split.merge(part, torch.cat([coded, win.index_select(1, split.coded_idx)], 2))

        keys, values = history_space("k", k_win, r_k, mu_k), history_space("v", v_win, r_v, mu_v)
        q = _on_int2_heads(group_queries(query, hk), int2, lambda x: torch.matmul(x.float(), r_k.float().unsqueeze(0)))
        q = q.reshape(1, hq, l, d)
    g = hq // hk
    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)  # [1, Hq, n + E + L, D]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(l, keys.shape[2]),
                                         scale=scaling)  # [1, Hq, L, D]
    if n:
        def back(x):  # R_Vᵀ, + mu_V
            x = torch.matmul(x.float(), r_v.float().transpose(-1, -2).unsqueeze(0))
            return x if mu_v is None else x + mu_v.float()[None, :, None]

        out = _on_int2_heads(group_queries(out, hk), int2, back).reshape(1, hq, l, d)
    return out.to(dt).transpose(1, 2)


def _on_int2_heads(x: torch.Tensor, int2: torch.Tensor | None, fn) -> torch.Tensor:
    """``x [1, Hk, M, D]`` with ``fn`` applied to the heads ``int2`` (every head when None), in ``x``'s dtype."""
    if int2 is None:
        return fn(x).to(x.dtype)
    if not int2.numel():
        return x
    x = x.clone()
    x[:, int2] = fn(x.index_select(1, int2)).to(x.dtype)
    return x


class PagedOscarKV(OscarKV):
    """What :meth:`OscarPagedCache.update` returns for a quantized layer: the packed new rows of every request of the
    batch (``key_states/value_states [1, Hk, sum L_i, D]``) and the batch's requests in packing order."""

    __slots__ = ("store", "layer_idx", "batch")

    def __init__(self, store: OscarPagedStore, layer_idx: int, key_states, value_states, batch):
        super().__init__(None, key_states, value_states)
        self.store, self.layer_idx, self.batch = store, layer_idx, batch

    @property
    def shape(self):
        b, h, l, d = self.key_states.shape
        return torch.Size((b, h, l + sum(past for _, past, _ in self.batch), d))

    def attend(self, query, attention_mask, scaling: float, module, base: str, **kwargs) -> torch.Tensor:
        """``[1, sum L_i, Hq, D]``: each request's rows attend to that request's cache only (the block-diagonal mask
        continuous batching builds is implied by the store's per-request bookkeeping, so it is not read; neither is
        ``cu_seq_lens_q``, a device tensor: reading it would stall every layer)."""
        if kwargs.get("s_aux") is not None or kwargs.get("softcap"):
            raise NotImplementedError("OSCAR serving does not implement attention sinks (s_aux) or logit soft-capping "
                                      "yet; OscarCache with generate does")
        return self.store.attend(self.layer_idx, query, self.key_states, self.value_states, self.batch, scaling,
                                 module, base)


class RecordedBatch:
    """What both paged caches (5.20+ and 5.17 - 5.19) keep for the store: the requests of a forward in packing order,
    recorded by Transformers' per-request hooks while it prepares the batch (the request ids never reach the
    forward) and taken by the forward's first OSCAR layer."""

    def _start_recording(self) -> None:
        self.scheduler = None  # the manager's scheduler (its request states), once its batch processor exists
        self._pending: list[tuple[str, int, int]] = []
        self._batch: list[tuple[str, int, int]] = []

    def _start_graphs(self, store, cb_config) -> None:
        """Before Transformers sizes the cache: when the manager graphs decode steps (``use_cuda_graph``: its decode
        boolean), the store's decode step becomes graph-safe for the padded batches it will see (``max_requests``
        decode rows at most, padded to ``q_padding_interval_size``): :meth:`OscarPagedStore.enable_graphs`."""
        self.cuda_graphs = bool(cb_config is not None and cb_config.cuda_graph_booleans[1])
        self.graph_step, self.graph_key = False, ()
        if self.cuda_graphs:
            q = max(1, cb_config.q_padding_interval_size or 1)
            store.enable_graphs(-(-store.windows.num_slots // q) * q)
        else:  # (a store reused by a manager without graphs)
            store.graph_rows = 0

    def prepare_forward(self, rows: int, packed: list[tuple[str, int, int]] | None = None) -> bool:
        """The host side of a forward, once Transformers has prepared the batch (every request recorded) and before
        the model runs or a CUDA graph replays: the store's decode plan, written into its fixed buffers (pages
        allocated, lengths advanced). ``rows``: the forward's packed rows, padding included; ``packed``: the requests
        Transformers packed, ``(request_id, past_length, query_length)`` in row order, which must be exactly the ones
        recorded (the store learns whose rows are whose only from the recording: a missed or reordered call would
        give requests each other's KV). Returns whether this step may run as a graph (a decode-only batch that fits
        the buffers, graphs on); ``graph_key`` then holds what else its graph depends on (the history bound its grids
        are sized for)."""
        if packed is not None and packed != self._pending:
            recorded, self._pending = self._pending, []
            raise RuntimeError(f"OSCAR paged cache: the forward packs {packed}, the cache recorded {recorded} (request "
                               "ids, past and new lengths, in row order): this Transformers version prepares batches "
                               "in a way oscar_hf does not follow")
        plan = self.store.plan_decode(self.batch(), rows if self.cuda_graphs else None)
        self.graph_step = plan is not None and plan.graphable
        self.graph_key = (plan.max_hist,) if self.graph_step else ()
        return self.graph_step

    def _record(self, request_id: str, past_length: int, query_length: int) -> None:
        self._pending.append((request_id, int(past_length), int(query_length)))
        # the scheduler has split the request's tokens for this step: what its state keeps for later steps is the rest
        # of the prompt (none: this step's chunk completes it). The store keeps a prompt's chunks exact while more
        # follow; without the scheduler (set by the OSCAR manager, serving/batching.py) None: until the request decodes
        state = self.scheduler.active_requests.get(request_id) if self.scheduler is not None else None
        rest = getattr(state, "remaining_prefill_tokens", None)
        self.store.note_prompt(request_id, None if rest is None else len(rest) > 0)

    def attach_scheduler(self, scheduler) -> None:
        """The manager's scheduler, whose request states say when a prompt is complete (:meth:`_record`) and how long
        it is (:meth:`_prompt_hold`)."""
        self.scheduler = scheduler

    def _prompt_hold(self, state, request_len: int) -> int:
        """Tokens of the store's ``prompt_budget`` that admitting ``request_len`` tokens of ``state`` (a Transformers
        ``RequestState``) this step needs: its whole prompt (what is left of it after ``position_offset`` tokens) when
        the scheduler splits it now (``request_len`` short of what is left) and it has no reservation yet, else 0."""
        rest = len(state.remaining_prefill_tokens)
        return self.store.prompt_hold(state.request_id, state.position_offset + rest, request_len < rest)

    def batch(self) -> list[tuple[str, int, int]]:
        """The requests of the running forward, ``(request_id, past_length, query_length)`` in packing order."""
        if self._pending:  # the first OSCAR layer of a forward: the requests recorded since the previous one
            self._batch, self._pending = self._pending, []
        return self._batch
