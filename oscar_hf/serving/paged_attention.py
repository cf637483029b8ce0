"""Read path of the paged store for one request's rows when they continue a request (a prompt chunk after earlier
tokens): :func:`paged_chunk_attention`. A continuing chunk can be a whole long prompt (Transformers' scheduler fills a
step's token budget with the first tokens of the next prompt and sends the rest next step), or a request's own rows
after a shared prefix: prefill-sized work over a long INT2 history, so the history is read in place through the
request's block table by the split-K kernels, a tile of query rows at a time
(:func:`oscar_hf.kernels.paged_decode.paged_history_partial`), never dequantized to a full-precision copy. The decode
rows of a batch (one token each) take :func:`oscar_hf.kernels.decode.decode` instead.

Shapes: ``Hk`` KV heads, ``g`` query heads per KV head, ``L`` new rows, ``E`` window entries before them, ``n`` history
entries of the request, ``P`` the page size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from oscar_hf.kernels.heads_attention import merge_heads
from oscar_hf.kernels.kv import History, KVParams, Pages, Window
from oscar_hf.kernels.paged_decode import LOGITS_BUDGET, paged_multi_token_attention

from ..attention import OscarKV
from ..cache import heads
from ..cache.base import group_queries, mask_rows
from .pool import PagedInt2Pool, device_ids


def _causal(query, keys, values, scaling: float):
    """``[1, H, L, D]``: SDPA of ``query [1, H, L, D]`` over ``keys/values [1, Hk, S, D]`` (repeated to ``H``), the
    ``L`` rows being the last ``L`` keys, causal among themselves."""
    g, l = query.shape[1] // keys.shape[1], query.shape[2]
    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(l, keys.shape[2]),
                                          scale=scaling)


def paged_chunk_attention(query, window: Window, pool: PagedInt2Pool, table: list[int], layer: int, n: int,
                          params: KVParams, scaling: float, use_kernels="auto") -> torch.Tensor:
    """``[1, L, Hq, D]``: the ``L`` new rows ``query [1, Hq, L, D]`` of one request over its history (``n`` entries
    through ``table``), then its window and new rows ``window.k/v [1, Hk, E + L, D]`` (the last ``L`` are the new
    rows, causal among themselves; everything before them is visible to every row; ``window.mask`` unused).

    ``params`` the layer's :class:`~oscar_hf.kernels.kv.KVParams`: its INT2 heads read the history in the rotated
    space and the window exactly (:func:`~oscar_hf.kernels.paged_decode.paged_multi_token_attention`); with
    retrieval heads (``params.heads``) those read their coded history (dequantized for the call: a few heads,
    :mod:`oscar_hf.cache.heads`) and their window unrotated in one SDPA call. With ``n == 0``: exact attention."""
    _, hq, l, d = query.shape
    k_win, v_win = window.k, window.v
    hk, dt = k_win.shape[1], query.dtype
    if not n:
        return _causal(query, k_win, v_win, scaling).transpose(1, 2)
    split, e, g, dev = params.heads, k_win.shape[2] - l, hq // hk, query.device
    ids = device_ids(table[: -(-n // pool.page_size)], torch.int32, dev)[None]  # [1, np]
    qg, out = group_queries(query, hk), None  # [1, Hk, g * L, D]
    if split is None or split.int2_idx.numel():
        pick = (lambda x: x) if split is None else (lambda x: x.index_select(1, split.int2_idx))
        history = History(pool.rows(layer, "k"), pool.rows(layer, "v"),
                          pages=Pages(ids, torch.full((1,), n, dtype=torch.int32, device=dev), n))
        # rows [a, b) at a time: their window logits [H2, g * (b - a), E + b] float32 stay within LOGITS_BUDGET
        step, parts = max(1, LOGITS_BUDGET // (4 * hq * (e + l))), []
        for a in range(0, l, step):
            b = min(l, a + step)
            visible = torch.arange(e + b, device=dev)[None, :] <= e + torch.arange(a, b, device=dev)[:, None]
            window = Window(pick(k_win[:, :, : e + b]), pick(v_win[:, :, : e + b]), mask_rows(visible[None], g))
            part = paged_multi_token_attention(params, pick(group_queries(query[:, :, a:b], hk)), window, history,
                                               scaling, dt, use_kernels)  # [1, H2, g * (b - a), D]
            parts.append(part.view(1, part.shape[1], g, b - a, d))
        out = torch.cat(parts, 3).view(1, -1, g * l, d)
    if split is not None:  # the retrieval heads: [coded history | window], unrotated
        c = split.coded_idx
        keys, values = (torch.cat([heads.decode(pool.gather_coded(ids.long(), layer, kind, n), split.bits, dt),
                                   win.index_select(1, c)], 2) for kind, win in (("k", k_win), ("v", v_win)))
        qc = qg.index_select(1, c).reshape(1, -1, l, d)  # [1, P * g, L, D]
        coded = _causal(qc, keys, values, scaling)  # [1, P * g, L, D]
        out = merge_heads(out, coded.reshape(1, c.numel(), -1, d), split.int2_idx, split.coded_idx, hk)
    return out.reshape(1, hq, l, d).to(dt).transpose(1, 2)


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
