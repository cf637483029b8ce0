"""`OscarPagedStore`: the OSCAR KV of every live request of a server, per request a window slot and INT2 history pages
(docs/serving.md section 3). Decode rows are served together (:mod:`.decode_step`), multi-token rows one request at a
time (:meth:`OscarPagedStore._attend_one`)."""
from __future__ import annotations

import torch

from oscar_hf.kernels.kv import Window

from ..cache.params import LayerParams
from ..cache.window import PagedHistory, commit, demote_pending
from ..config import OscarConfig, starting_config
from ..distributed import local_retrieval_heads, slice_layer_rotation, tp_layout
from ..layer_choice import choose_layers
from ..patching import base_attention_function
from ..rotations import OscarRotations
from .decode_step import DecodeBuffers, DecodeStep, StepPlan
from .paged_attention import paged_chunk_attention
from .pool import PagedInt2Pool
from .prefix import SharedPrefixes
from .requests import RequestKV, StoreRequests, WindowPool
from .warmup import warm_once

DEFAULT_MAX_REQUESTS = 64  # window slots when the caller gives none: requests live at once
# chunk length a standalone memory_budget= assumes for the prompt transient (Transformers' default max_batch_tokens;
# inside continuous batching the ContinuousBatchingConfig's own value is used)
DEFAULT_CHUNK_TOKENS = 8192


class OscarPagedStore(StoreRequests, DecodeStep, SharedPrefixes):
    """``rotations``: None for the artifact-free ``method``; ``overrides``: :class:`OscarConfig` fields; at most
    ``max_requests`` live requests and ``prompt_budget`` prompt tokens held in full precision (default:
    ``max_position_embeddings``); ``num_pages`` pages, or what ``memory_budget`` bytes pay for after
    :meth:`reserved_bytes`, or (``defer_pool``) none until :meth:`attach_pool`. ``prefix_sharing``: requests share
    prefix pages; ``retain_prefixes`` (keyword, default True) keeps them after their last holder leaves, till needed;
    ``warm_kernels`` (keyword, default False): a manager's cache compiles the read kernels' variants before it serves
    (:func:`oscar_hf.serving.warmup.warm_kernels`, once a process for a shape)."""

    def __init__(self, model_or_config, rotations: OscarRotations | None = None, config: OscarConfig | None = None, *,
                 num_pages: int | None = None, memory_budget: int | None = None, page_size: int = 256,
                 max_requests: int = DEFAULT_MAX_REQUESTS, prompt_budget: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, defer_pool: bool = False,
                 prefix_sharing: bool = False, **overrides):
        retain = overrides.pop("retain_prefixes", True)  # (keywords of their own: not OscarConfig fields)
        warm = overrides.pop("warm_kernels", False)
        config, default_group = starting_config(config, None, rotations, overrides)  # (as OscarCache)
        model_config = getattr(model_or_config, "config", model_or_config)
        if config.key_offset != "calibrated":
            raise NotImplementedError("the paged OSCAR store supports key_offset='calibrated' only")
        # the layers, group size and retrieval heads OscarCache gets; a layer whose every head is a 16-bit retrieval
        # head is exact: Transformers' own paged cache keeps it (at INT8 / INT4 it stays here with no INT2 head)
        choice = choose_layers(model_config, rotations, config, default_group=default_group)
        config, rotations, fp = choice.config, choice.rotations, choice.fingerprint
        hk = fp.num_key_value_heads
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current device, as its tensors say
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config, self.dtype = config, dtype
        self.num_kv_heads, self.head_dim = hk, fp.head_dim
        self.ring = config.recent + 1
        layers = list(choice.quantized_layers)
        if not layers:
            raise ValueError("the model has no layer OSCAR quantizes (full attention, with rotations, not skipped, "
                             "not every head a 16-bit retrieval head)")
        self.layer_slot = {layer: k for k, layer in enumerate(layers)}  # model layer -> pool layer index
        rots = {i: rotations.layers[i] for i in layers}
        heads = {i: choice.retrieval_heads.get(i, ()) for i in layers}
        self.num_query_heads = fp.num_attention_heads
        # tensor parallelism (tp_plan="auto"): this rank's own KV heads, their rotations and retrieval heads
        lay = self.tp_layout = tp_layout(model_or_config, hk, fp.head_dim, layers=set(layers))
        if lay is not None and lay.world > 1:
            counts = {lay.k[i].n for i in layers} | {lay.v[i].n for i in layers}
            if len(counts) != 1:
                raise NotImplementedError(f"tensor parallelism: rank {lay.rank} holds different numbers of KV heads "
                                          f"across layers ({sorted(counts)}); the paged store needs one count")
            self.num_kv_heads = counts.pop()
            self.num_query_heads = fp.num_attention_heads * self.num_kv_heads // hk
            rots = {i: slice_layer_rotation(rots[i], lay.k[i], lay.v[i]) for i in layers}
            heads = {i: local_retrieval_heads(heads[i], lay.k[i], lay.v[i], i, lay.rank) if heads[i] else ()
                     for i in layers}
        self.params = {i: LayerParams.build(config, rots[i], i, self.num_kv_heads, heads[i], self.device)
                       for i in layers}
        self._rotations_cpu = rots
        self.requests: dict[str, RequestKV] = {}
        self.windows = WindowPool(max_requests, len(layers), self.num_kv_heads, config.sink + self.ring, fp.head_dim,
                                  dtype, self.device)
        # the longest expected history: sizes the decode buffers' block tables (a longer one takes fresh tensors)
        self.max_positions = getattr(model_config.get_text_config(decoder=True), "max_position_embeddings", None)
        prompt_budget = self.max_positions if prompt_budget is None else prompt_budget
        if not isinstance(prompt_budget, int) or isinstance(prompt_budget, bool) or prompt_budget < 1:
            raise ValueError("prompt_budget must be a positive number of tokens (of prompts held in full precision at "
                             "once while they arrive in chunks; default: the model config's max_position_embeddings), "
                             f"got {prompt_budget!r}")
        self.prompt_budget = prompt_budget
        self._warned_prompt = False
        self._plan: StepPlan | None = None
        self._buffers: DecodeBuffers | None = None
        self.kv_params = {i: p.kv(config, p.mu_k, p.mu_v) for i, p in self.params.items()}  # the kernels' bundles
        self.graph_rows = 0  # CUDA graphs (enable_graphs): the most rows of a graphed decode step; 0 = off
        self.pool: PagedInt2Pool | None = None
        self.warm_kernels = warm  # a manager's cache runs oscar_hf.serving.warmup before it serves (once a process)
        for name, value in (("prefix_sharing", prefix_sharing), ("retain_prefixes", retain), ("warm_kernels", warm)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self.prefix_sharing, self.prefixes = prefix_sharing, None  # the PrefixIndex comes with the pool
        self.retain_prefixes = prefix_sharing and retain
        self.share_room: int | None = None  # kept pages the next share_prefix may take (a paged cache's free blocks)
        self._deferred = defer_pool
        if (num_pages is not None) + (memory_budget is not None) + bool(defer_pool) != 1:
            raise ValueError("size the pool with exactly one of num_pages=, memory_budget= (bytes) or defer_pool=True "
                             "(sized when attached)")
        if defer_pool:
            return
        if num_pages is None:
            num_pages = self.pages_in(int(memory_budget), page_size, min(DEFAULT_CHUNK_TOKENS, prompt_budget))
        self.attach_pool(num_pages, page_size)

    def warm(self, **bounds) -> dict:
        """Compile the read kernels' variants for this store's shapes (:func:`~oscar_hf.serving.warmup.warm_once`,
        ``bounds`` its grid's); a manager's cache calls it when built if the store was made with ``warm_kernels``."""
        return warm_once(self, **bounds)

    # ------------------------------------------------------------------ one forward of a batch
    def attend(self, layer_idx: int, query: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, batch,
               scaling: float, module, base: str) -> torch.Tensor:
        """``[1, Q, Hq, D]``: one layer of a packed forward. ``query [1, Hq, Q, D]``, ``new_k/new_v [1, Hk, Q, D]``,
        ``batch``: ``(request_id, past_length, L_i)`` in packing order (rows past ``sum L_i`` are graph padding and
        get 0). Each request's rows attend causally to its cache and new rows, which are then stored."""
        total = sum(q for _, _, q in batch)
        if total > query.shape[2] or new_k.shape[2] != query.shape[2]:
            raise RuntimeError(f"OSCAR paged attention: the batch holds {total} new tokens, the query "
                               f"{query.shape[2]}, the keys {new_k.shape[2]}")
        plan = self._plan if self._plan is not None and self._plan.key == tuple(batch) else self.plan_decode(batch)
        out = query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
        start = 0
        for rid, past, q_len in batch:
            if not (q_len == 1 and past > 0):  # a prompt or a chunk of one: one request at a time
                sl = slice(start, start + q_len)
                self._request(rid, layer_idx, past, new_k)
                out[:, sl] = self._attend_one(rid, layer_idx, past, query[:, :, sl], new_k[:, :, sl],
                                              new_v[:, :, sl], scaling, module, base)
            start += q_len
        if plan is not None:
            out[0, plan.write.pos] = self._decode(layer_idx, plan, query, new_k, new_v, scaling)
        return out

    # ------------------------------------------------------------------ multi-token rows, one request at a time
    def _attend_one(self, request_id: str, layer_idx: int, t_old: int, query, new_k, new_v, scaling: float, module,
                    base: str) -> torch.Tensor:
        """``[1, L, Hq, D]``: one request's ``L`` new rows (a prompt or a chunk of one), then stored."""
        r = self.requests[request_id]
        s0, w, l = self.config.sink, self.config.recent, query.shape[2]
        li, p = self.layer_slot[layer_idx], self.params[layer_idx]
        win_k, win_v = self.windows.k[r.slot, li][None], self.windows.v[r.slot, li][None]  # [1, Hk, S0 + R, D] views
        earlier = r.prompt.pop(li, None)  # [1, Hk, T, D] keys and values of the prompt's earlier chunks, if kept
        exact = earlier is not None and earlier[0].shape[2] == t_old
        dev = query.device
        if t_old == 0 or exact:  # a new request, or a later chunk of a prompt: exactly the user's attention over it
            k_all, v_all, mask = new_k, new_v, None  # a new request: the attention function's own causal mask
            if exact:  # [1, Hk, T + L, D]: every earlier chunk, then the new rows
                k_all, v_all = torch.cat([earlier[0], new_k], 2), torch.cat([earlier[1], new_v], 2)
                earlier = None  # freed before the attention call repeats K/V (prompt_transient_bytes counts on it)
                # [1, 1, L, T + L] additive causal mask: new row i sees slots [0, T + i]
                mask = torch.full((1, 1, l, t_old + l), float("-inf"), dtype=query.dtype, device=dev).triu(t_old + 1)
            out, _ = base_attention_function(module, base)(module, query, k_all, v_all, mask, scaling=scaling,
                                                           dropout=0.0)
        else:  # the history, the sink and the ring's slots [max(S0, T - W), T), then the new rows (causal)
            # slots below r.floor are history whatever the window (a shared prefix's pages, never written here)
            hist_end = max(t_old - w, r.floor)
            if t_old - w - 1 >= r.floor:  # (below the floor: a shared prefix's page, never written here)
                demote_pending(win_k, win_v, self._history(r, li, t_old - w), p, self.config, t_old)
            # the sink's entries, then the ring's of slots [max(S0, hist_end), T) (made once a forward, not per layer)
            lo, ring = min(t_old, max(s0, hist_end)), self.ring
            entries = self.pool.ids([*range(min(t_old, s0)), *(s0 + j % ring for j in range(lo, t_old))], torch.long)
            k_win = torch.cat([win_k.index_select(2, entries), new_k], 2)  # [1, Hk, E + L, D]
            v_win = torch.cat([win_v.index_select(2, entries), new_v], 2)
            out = paged_chunk_attention(query, Window(k_win, v_win), self.pool, r.table, li, max(hist_end - s0, 0),
                                        self.kv_params[layer_idx], scaling, self.config.use_kernels)
        # no padding: the request's sink is its slots [0, S0)
        commit(win_k, win_v, 0, self._history(r, li, t_old + l - w), p, self.config, t_old, new_k, new_v,
               floor=r.floor)
        r.lengths[layer_idx] = t_old + l
        # more of the prompt may come: kept exact within the reservation (without a scheduler: until the first decode)
        keep = r.prompt_more is None or (r.prompt_more and t_old + l <= r.prompt_reserved)
        if keep and (t_old == 0 or exact):
            r.prompt[li] = (k_all, v_all) if exact else (new_k.contiguous(), new_v.contiguous())
        return out

    def _history(self, r: RequestKV, li: int, end: int) -> PagedHistory:
        """Request ``r``'s history of pool layer ``li``, with pages allocated for the slots below ``end``."""
        self._pages_for(r, end - self.config.sink)
        return PagedHistory(self.pool, r.table, li)
