"""The read of rows that continue a request (:func:`paged_chunk_attention`: a prompt chunk, rows after a shared
prefix; docs/serving.md section 3, "Prompts"), and what both paged caches share (:class:`PagedOscarKV`,
:class:`RecordedBatch`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

from oscar_hf.kernels.heads_attention import merge_heads
from oscar_hf.kernels.kv import History, KVParams, Pages, Window
from oscar_hf.kernels.paged_decode import LOGITS_BUDGET, paged_multi_token_attention

from ..attention import OscarKV
from ..cache import heads
from ..cache.base import group_queries, mask_rows
from .pool import PagedInt2Pool


def _causal(query, keys, values, scaling: float):
    """``[1, H, L, D]``: SDPA of ``query [1, H, L, D]`` over ``keys/values [1, Hk, S, D]`` (repeated to ``H``), the
    ``L`` rows being the last ``L`` keys, causal among themselves."""
    g, l = query.shape[1] // keys.shape[1], query.shape[2]
    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(l, keys.shape[2]),
                                          scale=scaling)


def paged_chunk_attention(query, window: Window, pool: PagedInt2Pool, table: list[int], layer: int, n: int,
                          params: KVParams, scaling: float, use_kernels="auto") -> torch.Tensor:
    """``[1, L, Hq, D]``: the ``L`` new rows ``query [1, Hq, L, D]`` of one request over its ``n`` history entries
    (through ``table``, read in place), then ``window.k/v [1, Hk, E + L, D]``: ``E`` entries every row sees and the new
    rows, causal. The retrieval heads (``params.heads``) read their decoded history and window in one SDPA call."""
    _, hq, l, d = query.shape
    k_win, v_win = window.k, window.v
    hk, dt = k_win.shape[1], query.dtype
    if not n:
        return _causal(query, k_win, v_win, scaling).transpose(1, 2)
    split, e, g = params.heads, k_win.shape[2] - l, hq // hk
    ids = pool.ids(table[: -(-n // pool.page_size)], torch.int32)[None]  # [1, np]
    out = None  # [1, H2, g * L, D]: the INT2 heads' rows
    if split is None or split.int2_idx.numel():
        pick = (lambda x: x) if split is None else (lambda x: x.index_select(1, split.int2_idx))
        history = History(pool.rows(layer, "k"), pool.rows(layer, "v"), pages=Pages(ids, pool.ids([n], torch.int32), n))
        # rows [a, b) at a time: their window logits [H2, g * (b - a), E + b] float32 stay within LOGITS_BUDGET
        step, parts = max(1, LOGITS_BUDGET // (4 * hq * (e + l))), []
        for a in range(0, l, step):
            b = min(l, a + step)
            # [1, 1, g * (b - a), E + b]: row i sees the E entries and new rows up to its own (made once a forward)
            visible = pool.kept(("causal", e, a, b, g), lambda dev: mask_rows(
                (torch.arange(e + b, device=dev)[None, :] <= e + torch.arange(a, b, device=dev)[:, None])[None], g))
            window = Window(pick(k_win[:, :, : e + b]), pick(v_win[:, :, : e + b]), visible)
            part = paged_multi_token_attention(params, pick(group_queries(query[:, :, a:b], hk)), window, history,
                                               scaling, dt, use_kernels)  # [1, H2, g * (b - a), D]
            parts.append(part.view(1, part.shape[1], g, b - a, d))
        out = torch.cat(parts, 3).view(1, -1, g * l, d)
    if split is not None:  # the retrieval heads: [coded history | window], unrotated
        c = split.coded_idx
        keys, values = (torch.cat([heads.decode(pool.gather_coded(ids.long(), layer, kind, n), split.bits, dt),
                                   win.index_select(1, c)], 2) for kind, win in (("k", k_win), ("v", v_win)))
        qc = group_queries(query, hk).index_select(1, c).reshape(1, -1, l, d)  # [1, P * g, L, D]
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
        """``[1, sum L_i, Hq, D]``: each request's rows attend to its own cache (the block-diagonal mask and the device
        tensor ``cu_seq_lens_q`` are not read: the batch recording says the same without a sync)."""
        if kwargs.get("s_aux") is not None or kwargs.get("softcap"):
            raise NotImplementedError("OSCAR serving does not implement attention sinks (s_aux) or logit soft-capping "
                                      "yet; OscarCache with generate does")
        return self.store.attend(self.layer_idx, query, self.key_states, self.value_states, self.batch, scaling,
                                 module, base)


class RecordedBatch:
    """What both paged caches keep for the store: a forward's requests in packing order, recorded by Transformers'
    per-request hooks (the ids never reach the forward) and taken by its first OSCAR layer."""

    def _start_recording(self, store) -> None:
        """The end of a paged cache's ``__init__``: the store bound, its window slots allocated (a captured graph
        holds their addresses); prefix sharing is the store's (Transformers' would match BF16 blocks never written)."""
        self.store = store
        self.allow_block_sharing = self.use_prefix_sharing = (
            self.oscar_owns_memory and store.prefix_sharing and self.allow_block_sharing)
        store.windows.allocate_all(trash=self.cuda_graphs)
        if store.warm_kernels:  # (after the pool and the graph rows: their sizes bound the grid)
            store.warm(max_chunk=getattr(self, "max_batch_tokens", None))
        self.scheduler = None  # the manager's scheduler (its request states), once its batch processor exists
        self._pending: list[tuple[str, int, int]] = []
        self._batch: list[tuple[str, int, int]] = []

    def _start_graphs(self, store, config, cb_config) -> None:
        """Before Transformers sizes the cache: whether the store holds every layer (``oscar_owns_memory``: no BF16 K/V,
        the pool follows Transformers' blocks); under CUDA graphs, ``max_requests`` rows padded as Transformers pads."""
        groups = group_layers_by_attn_type(config)  # 5.20+: {type: layers}; 5.17 - 5.19: (layers per group, types)
        groups, types = (list(groups.values()), list(groups)) if isinstance(groups, dict) else groups
        self.oscar_owns_memory = types == ["full_attention"] and all(store.handles(i) for i in groups[0])
        if not self.oscar_owns_memory and not store.has_pool:  # the user sizes the pool, else Transformers' blocks
            raise ValueError("this model has layers OSCAR does not quantize (sliding windows / skip_layers): its BF16 "
                             "paged cache stays and the INT2 pool is sized apart: give num_pages= or memory_budget=")
        if self.oscar_owns_memory and not store._deferred:
            raise ValueError("the INT2 pool follows Transformers' blocks for this model: size it with "
                             "ContinuousBatchingConfig(num_blocks= / max_memory_percent=), not num_pages= / "
                             "memory_budget=")
        self.cuda_graphs = bool(cb_config is not None and cb_config.cuda_graph_booleans[1])
        self.graph_step, self.graph_key = False, ()
        if self.cuda_graphs:
            q = max(1, cb_config.q_padding_interval_size or 1)
            store.enable_graphs(-(-store.windows.num_slots // q) * q)
        else:  # (a store reused by a manager without graphs)
            store.graph_rows = 0

    def prepare_forward(self, rows: int, packed: list[tuple[str, int, int]]) -> None:
        """Before the model runs or a graph replays: the store's decode plan into its fixed buffers; ``graph_step``:
        whether the step may run as a graph (``graph_key``: its history bound). ``rows``: packed rows, padding
        included; ``packed``: what Transformers packed, equal to the recording (else requests read each other's KV)."""
        if packed != self._pending:
            recorded, self._pending = self._pending, []
            raise RuntimeError(f"OSCAR paged cache: the forward packs {packed}, the cache recorded {recorded} (request "
                               "ids, past and new lengths, in row order): this Transformers version prepares batches "
                               "in a way oscar_hf does not follow")
        plan = self.store.plan_decode(self.batch(), rows if self.cuda_graphs else None)
        self.graph_step = plan is not None and plan.graphable
        self.graph_key = (plan.pages.max_len,) if self.graph_step else ()

    def _record(self, request_id: str, past_length: int, query_length: int) -> None:
        self._pending.append((request_id, int(past_length), int(query_length)))
        # what the scheduler's state keeps for later steps is the rest of the prompt (None without a scheduler)
        state = self.scheduler.active_requests.get(request_id) if self.scheduler is not None else None
        rest = getattr(state, "remaining_prefill_tokens", None)
        if (r := self.store.requests.get(request_id)) is not None:  # (RequestKV.prompt_more)
            r.prompt_more = None if rest is None else len(rest) > 0

    def attach_scheduler(self, scheduler) -> None:
        """The manager's scheduler, whose request states say when a prompt is complete and how long it is."""
        self.scheduler = scheduler

    def _prompt_hold(self, state, request_len: int) -> int:
        """Tokens of ``prompt_budget`` this step's ``request_len`` tokens of ``state`` need: its whole prompt when the
        scheduler splits it and none is reserved yet, else 0."""
        rest = len(state.remaining_prefill_tokens)
        r = self.store.requests.get(state.request_id)
        return 0 if request_len >= rest or (r is not None and r.prompt_reserved) else state.position_offset + rest

    def free_blocks(self, request_id: str, *args, **kwargs) -> None:
        super().free_blocks(request_id, *args, **kwargs)
        self.store.free(request_id)

    def free_all_requests(self, *args, **kwargs) -> None:
        super().free_all_requests(*args, **kwargs)
        self.store.free_all()

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """Prompt tokens a new request takes from a live request's pages; Transformers' accounting then holds the
        holder's first blocks for it too (``_share_blocks``), so admission counts them once."""
        if not self.use_prefix_sharing:
            return 0
        self.store.share_room = self.get_num_free_blocks()  # for retained pages a new request takes (_share_blocks)
        m, holder, k = self.store.share_prefix(request_id, list(prompt_ids))
        if m:
            self._share_blocks(request_id, holder, k)
        return m

    def batch(self) -> list[tuple[str, int, int]]:
        """The requests of the running forward, ``(request_id, past_length, query_length)`` in packing order."""
        if self._pending:  # the first OSCAR layer of a forward: the requests recorded since the previous one
            self._batch, self._pending = self._pending, []
        return self._batch
