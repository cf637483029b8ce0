"""`OscarPagedStore`: the OSCAR KV of every live request of a server: per request a full-precision sink + recent
window (a slot of one :class:`WindowPool`), and its INT2 history in pages of one :class:`PagedInt2Pool`.

Per request and quantized layer, with ``S0 = sink``, ``W = recent``, ``R = W + 1``, ``T`` tokens seen (no padding:
every request is its own sequence), the layout of :mod:`oscar_hf.cache.window` (the compiled
:class:`~oscar_hf.cache.static.StaticOscarLayer`'s with one row and no crop reserve in the ring), whose writes it
shares (a request's window slot as the window, :class:`~oscar_hf.cache.window.PagedHistory` as the history):

* window slot ``[S0 + R, D]`` per KV head (model dtype): entries ``[0, S0)`` the sink (slots ``[0, S0)``), entries
  ``[S0, S0 + R)`` a ring holding slot ``s`` at entry ``S0 + s % R``;
* history: slots ``[S0, T - W)`` as entries ``j = slot - S0`` of the request's pages (block table shared by its
  layers: page ``table[j // P]`` holds entries ``[P * (j // P), P * (j // P + 1))`` of every layer).

**Retrieval heads** (``OscarConfig.full_precision_heads``: the artifact's by default, resolved as
:class:`~oscar_hf.OscarCache` does) stay out of the INT2 rows: a layer's pages hold its other heads in INT2 and these
heads' history entries as coded rows (:mod:`oscar_hf.cache.heads`, ``full_precision_bits``), written beside the INT2
row of the same entry and freed with the same pages. They read their coded history and the exact window, unrotated
(:class:`~oscar_hf.cache.params.LayerParams` splits a layer's heads); the INT2 path serves the other heads. A layer
whose every head is a 16-bit retrieval head is exact and left to Transformers' paged cache, as ``OscarCache`` leaves it to Transformers' layer.

**Decode rows** (one new token, ``T > 0``) of a forward are served together, one batched call per layer: the write
(:func:`~oscar_hf.kernels.write_path.paged_append`, one Triton launch on CUDA: slot ``T - 1 - W``, which left the
window at the previous step, is quantized into the request's current page; the new token goes to ring entry
``S0 + T % R`` and, while ``T < S0``, to the sink), then one paged decode attention
over the history (through the block tables) and the window slots
(:func:`~oscar_hf.kernels.paged_decode.paged_decode_attention`: the split-K Triton kernel on CUDA). What the rows
share across layers (slots, entries, pages, block tables, window masks) is planned on the host before the forward
and written into fixed device buffers (:meth:`OscarPagedStore.plan_decode`, :class:`DecodePlan`); the forward is
device work only, so that Transformers' CUDA graphs may capture and replay it (padded rows go to a trash window slot
and the pool's trash page; docs/serving.md, "CUDA graphs"). **Multi-token rows** (a prompt, a prompt chunk) are
served one request at a time: the user's attention over the prompt when the request is new, else one SDPA call over history + window + the new rows
(:func:`~oscar_hf.serving.paged_attention.paged_chunk_attention`); then they are stored
(:func:`~oscar_hf.cache.window.commit`: the slots leaving the window demoted in ``prefill_chunk`` pieces).

Requests get their window slot when admitted (:meth:`OscarPagedStore.reserve`, or at their first forward) and give
slot and pages back with :meth:`OscarPagedStore.free`. Memory is bounded: the page pool is allocated once, the window
slots grow on demand up to ``max_requests``, and a prompt arriving in chunks holds its chunks in full precision only
within ``prompt_budget`` (:meth:`OscarPagedStore.reserved_bytes` is what these take at most, beside the pool).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from oscar_hf.kernels.heads_attention import heads_decode_attention
from oscar_hf.kernels.paged_decode import paged_decode_attention
from oscar_hf.kernels.write_path import CodedSlots, PagedRows, paged_append

from ..cache import resolve_full_precision_heads
from ..cache.base import check_first_keys, group_queries
from ..cache.params import LayerParams
from ..cache.window import PagedHistory, commit, demote_pending, ring_entries, window_mask
from ..config import FULL_LAYER_TYPES, ModelFingerprint, OscarConfig, starting_config, validate_head_dim
from ..distributed import local_full_precision_heads, slice_layer_rotation, tp_layout
from ..patching import base_attention_function
from ..rotations import OscarRotations
from .paged_attention import paged_chunk_attention
from .pool import PagedInt2Pool, PoolExhausted, page_bytes

DEFAULT_MAX_REQUESTS = 64  # window slots when the caller gives none: requests live at once
# chunk length a standalone memory_budget= assumes for the prompt transient (Transformers' default max_batch_tokens;
# inside continuous batching the ContinuousBatchingConfig's own value is used)
DEFAULT_CHUNK_TOKENS = 8192

logger = logging.getLogger("oscar_hf")


class WindowPool:
    """Full-precision windows of up to ``num_slots`` live requests: ``k, v [capacity, L, Hk, S0 + R, D]`` (model dtype;
    ``L`` quantized layers) and a free list of slots.

    Allocated on demand, not up front: ``capacity`` starts at 0 and doubles (at most ``num_slots``) when a request is
    admitted and no allocated slot is free, and goes back to 0 with :meth:`release_memory` when no request is live (a
    manager stopping). At the Qwen3-8B shape a slot is 47 MB (36 layers x 8 heads x 321 entries x 128 x 2 x 2 bytes),
    so 64 slots held from the start were 3 GB idle. The most they take, ``reserved_bytes``, is what the store's memory
    plan reserves for them (:meth:`OscarPagedStore.reserved_bytes`). A growth copies the live slots through host
    memory, so that the device never holds the old and the new tensors at once (nothing above ``reserved_bytes``); it
    happens at admission, between forwards, at most log2(num_slots) + 1 times until the next release."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, entries: int, head_dim: int,
                 dtype: torch.dtype, device):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"the window pool needs at least one slot, got max_requests={num_slots!r}")
        self.slot_shape = (num_layers, num_kv_heads, entries, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.num_slots = num_slots  # the most live requests (admission's limit)
        self.k = self.v = torch.empty((0, *self.slot_shape), dtype=dtype, device=self.device)
        self._free: list[int] = []  # allocated slots nobody holds
        self._held = 0
        # CUDA graphs (:meth:`fix`): every slot allocated at once plus one trash slot, the last row of k / v, that the
        # padded rows of a graphed step write to; None otherwise
        self.with_trash = False
        self.trash_slot: int | None = None

    @property
    def capacity(self) -> int:
        """Slots allocated now (the rows of ``k`` but the trash slot)."""
        return self.k.shape[0] - (self.trash_slot is not None)

    @property
    def num_free(self) -> int:
        """Slots admission can still hand out (allocated or not)."""
        return self.num_slots - self._held

    @property
    def slot_bytes(self) -> int:
        return 2 * torch.Size(self.slot_shape).numel() * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes allocated now."""
        return self.capacity * self.slot_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of ``num_slots`` slots (and the trash slot under CUDA graphs): the most the pool takes."""
        return (self.num_slots + self.with_trash) * self.slot_bytes

    def fix(self) -> None:
        """Allocate every slot now, and the trash slot (``with_trash``): a CUDA graph captured over the decode step
        holds the windows' addresses, so they must not move while the manager lives (no growth on demand)."""
        if self.trash_slot is None:
            self.with_trash = True
            self._grow(self.num_slots, trash=True)

    def allocate(self) -> int:
        if self._held == self.num_slots:
            raise PoolExhausted(f"all {self.num_slots} window slots are taken: raise max_requests")
        if not self._free:
            self._grow()
        self._held += 1
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._held -= 1

    def _grow(self, new: int | None = None, trash: bool = False) -> None:
        old = self.capacity
        new = min(self.num_slots, max(1, 2 * old)) if new is None else new
        free = set(self._free)
        live = [s for s in range(old) if s not in free]
        idx = torch.tensor(live, dtype=torch.long, device=self.device)
        kept = [x.index_select(0, idx).cpu() for x in (self.k, self.v)]  # [live, L, Hk, S0 + R, D] on the host
        self.k = self.v = None  # the old tensors go before the new ones come
        rows = new + trash
        self.k, self.v = (torch.zeros((rows, *self.slot_shape), dtype=self.dtype, device=self.device) for _ in "kv")
        for dst, src in zip((self.k, self.v), kept):
            dst[idx] = src.to(self.device)
        self.trash_slot = new if trash else None
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def release_memory(self) -> None:
        """Give the slots' memory back (only while none is held)."""
        if self._held:
            raise RuntimeError(f"{self._held} window slots are still held")
        self.k = self.v = torch.empty((0, *self.slot_shape), dtype=self.dtype, device=self.device)
        self._free = []
        self.with_trash, self.trash_slot = False, None


@dataclasses.dataclass
class RequestKV:
    """One live request: its window slot, its block table (history pages, shared by its layers) and the tokens each
    quantized layer has stored (the layers of one forward advance one after the other). While its prompt arrives in
    chunks, ``prompt[layer]`` keeps the chunks so far in full precision (``[1, Hk, T, D]`` keys and values), so that a
    later chunk attends to them exactly, as a prompt sent in one piece does; ``prompt_more`` says whether the
    scheduler has more of the prompt to send after this step (None: not known, kept until the first decode step).
    ``prompt_reserved`` is the share of the store's ``prompt_budget`` the request was given for that (its prompt's
    length, reserved when the scheduler first split it: :meth:`OscarPagedStore.admit_prompt`); under a scheduler
    (``prompt_more`` known) chunks are kept only within it."""

    slot: int
    table: list[int]
    lengths: dict[int, int]
    prompt: dict = dataclasses.field(default_factory=dict)
    prompt_more: bool | None = None
    prompt_reserved: int = 0

    def length(self) -> int:
        return max(self.lengths.values(), default=0)


@dataclasses.dataclass
class DecodePlan:
    """What the decode rows of one forward read, shared by its layers: ``Bp`` rows, the batch's decode rows and (a
    CUDA-graphed step) its padded rows, as views of the store's fixed device buffers (:class:`DecodeBuffers`; fresh
    tensors only when a step outgrows them, never in a graphed step). Built on the host before the forward
    (:meth:`OscarPagedStore.plan_decode`); the forward only reads it, so a replayed graph reads the next step's."""

    key: tuple  # the batch it was built for
    pos: torch.Tensor  # [Bp] long: the rows' positions in the packed batch
    slots: torch.Tensor  # [Bp] long: window slots (padded rows: the trash slot)
    new_entry: torch.Tensor  # [Bp] long: ring entry of the new token
    sink_entry: torch.Tensor  # [Bp] long: its sink entry while T < S0, else new_entry again (the same value, twice)
    demote_entry: torch.Tensor  # [Bp] long: ring entry of slot T - 1 - W, which left the window at the previous step
    demote_page: torch.Tensor  # [Bp] long: its destination page (the pool's trash page for rows that demote none) ...
    demote_off: torch.Tensor  # [Bp] long: ... and offset in it
    block_table: torch.Tensor  # [Bp, ceil(max_hist / P)] int32 (-1 past a row's pages)
    hist_len: torch.Tensor  # [Bp] int32: history entries after the demotion
    hist_start: torch.Tensor  # [Bp] long zeros: every row's history from entry 0 (the retrieval heads' read)
    win_mask: torch.Tensor  # [Bp, S0 + R] bool
    max_hist: int  # the grid's history bound (host int >= max(hist_len)): exact, or its bucket in a graphed step
    write_sink: bool  # whether any row writes a sink entry (always in a graphed step: one graph serves every step)
    demote: bool  # whether any row demotes (likewise)
    graphable: bool  # every tensor above is a view of the fixed buffers and the shapes depend on the bucket only
    requests: list  # [(request_id, T)] of the real rows, in row order

    @property
    def rows(self) -> int:
        return self.pos.shape[0]

    @property
    def write_rows(self) -> PagedRows:
        """What the step's write reads per row (:func:`~oscar_hf.kernels.write_path.paged_append`)."""
        return PagedRows(self.pos, self.slots, self.new_entry, self.sink_entry, self.demote_entry, self.demote_page,
                         self.demote_off)


class DecodeBuffers:
    """The fixed device tensors a decode step reads (:class:`DecodePlan` holds views of them): allocated once per
    store and size, written on the host side of each step (one copy per tensor) before the forward, so that a CUDA
    graph captured over the forward replays with the next step's rows. ``rows`` x ``cols``: the most rows a step
    takes and the most pages a row's history spans."""

    FIELDS = ("pos", "slots", "new_entry", "sink_entry", "demote_entry", "demote_page", "demote_off", "t")

    def __init__(self, rows: int, cols: int, entries: int, device):
        self.rows, self.cols = rows, cols
        self.index = torch.zeros(len(self.FIELDS), rows, dtype=torch.long, device=device)  # [8, rows]
        self.table = torch.full((rows, cols), -1, dtype=torch.int32, device=device)
        self.hist_len = torch.zeros(rows, dtype=torch.int32, device=device)
        self.hist_start = torch.zeros(rows, dtype=torch.long, device=device)  # never written
        self.win_mask = torch.zeros(rows, entries, dtype=torch.bool, device=device)


def history_bucket(n: int, page_size: int) -> int:
    """The history bound a graphed step's grid is sized for: ``n`` rounded up to a power of two of pages (0 stays 0),
    so that a batch size needs about log2(pages) graphs, each within 2x of the rows' longest history."""
    if n <= 0:
        return 0
    pages = -(-n // page_size)
    return page_size * (1 << (pages - 1).bit_length())


class OscarPagedStore:
    """The paged OSCAR KV store of a server (see the module docstring).

    ``OscarPagedStore(model_or_config, rotations=None, config=None, *, num_pages=None, memory_budget=None,
    page_size=256, max_requests=64, prompt_budget=None, device="cpu", dtype=torch.float32, **overrides)``:
    ``rotations`` an :class:`OscarRotations` or None for the artifact-free ``method``; ``overrides`` are
    :class:`OscarConfig` fields. At most ``max_requests`` requests are live (a window slot each, allocated on demand:
    :class:`WindowPool`); at most ``prompt_budget`` prompt tokens (default: the model's ``max_position_embeddings``)
    are held in full precision while their prompts arrive in chunks (:meth:`admit_prompt`). The page pool holds
    ``num_pages`` pages, or as many as ``memory_budget`` bytes pay for after :meth:`reserved_bytes` (the windows at
    ``max_requests`` and the prompt budget); with ``defer_pool=True`` it has no page pool until
    :meth:`attach_pool` (what :func:`~oscar_hf.serving.paged_oscar` does: the pages then live in Transformers' paged
    cache tensor, sized by its scheduler). Layers the store does not quantize (``skip_layers``, sliding-window
    layers) are left to Transformers' own paged cache (:meth:`handles`)."""

    def __init__(self, model_or_config, rotations: OscarRotations | None = None, config: OscarConfig | None = None, *,
                 num_pages: int | None = None, memory_budget: int | None = None, page_size: int = 256,
                 max_requests: int = DEFAULT_MAX_REQUESTS, prompt_budget: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, defer_pool: bool = False,
                 **overrides):
        config, default_group = starting_config(config, None, rotations, overrides)  # (as OscarCache)
        model_config = getattr(model_or_config, "config", model_or_config)
        if rotations is None:
            rotations = OscarRotations.builtin(model_config, config.method)
        else:
            rotations.check_compatible(model_config)
        fp = ModelFingerprint.from_config(model_config)
        config = config.for_head_dim(fp.head_dim, default_group=default_group)
        validate_head_dim(fp, config.group_size)
        if config.key_offset != "calibrated":
            raise NotImplementedError("the paged OSCAR store supports key_offset='calibrated' only")
        if config.recent < 1:
            raise ValueError("the paged OSCAR store needs recent >= 1 (the ring of the recent window)")
        skipped = config.skipped(fp.num_layers)
        fp_heads = resolve_full_precision_heads(config, rotations, fp, skipped)  # {layer: heads}, as OscarCache's
        if fp_heads:  # the config names the heads, not "the top k"
            pairs = tuple(sorted((i, h) for i, hs in fp_heads.items() for h in hs))
            config = config.replace(full_precision_heads=pairs)
        hk = fp.num_key_value_heads
        # a layer whose every head is a 16-bit retrieval head is exact: Transformers' own paged cache keeps it (as
        # OscarCache gives it Transformers' layer); at INT8 / INT4 it stays here with no INT2 head
        exact = {i for i, hs in fp_heads.items() if len(hs) == hk and config.full_precision_bits == 16}
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.num_kv_heads, self.head_dim = hk, fp.head_dim
        self.ring = config.recent + 1
        layers = [i for i, t in enumerate(fp.layer_types)
                  if t in FULL_LAYER_TYPES and i not in skipped and i in rotations.layers and i not in exact]
        if not layers:
            raise ValueError("the model has no layer OSCAR quantizes (full attention, with rotations, not skipped, "
                             "not every head a 16-bit full-precision head)")
        self.layer_slot = {layer: k for k, layer in enumerate(layers)}  # model layer -> pool layer index
        rots = {i: rotations.layers[i] for i in layers}
        heads = {i: fp_heads.get(i, ()) for i in layers}
        self.num_query_heads = fp.num_attention_heads
        # tensor parallelism (a model loaded with tp_plan="auto"): this rank's pages and windows hold its own KV heads,
        # with the rotations, offsets and retrieval heads of those heads (as OscarCache under TP)
        self.tp_layout = tp_layout(model_or_config, hk, fp.head_dim, layers=set(layers))
        if self.tp_layout is not None and self.tp_layout.world > 1:
            lay = self.tp_layout
            counts = {lay.k[i].n for i in layers} | {lay.v[i].n for i in layers}
            if len(counts) != 1:
                raise NotImplementedError(f"tensor parallelism: rank {lay.rank} holds different numbers of KV heads "
                                          f"across layers ({sorted(counts)}); the paged store needs one count")
            self.num_kv_heads = counts.pop()
            self.num_query_heads = fp.num_attention_heads * self.num_kv_heads // hk
            rots = {i: slice_layer_rotation(rots[i], lay.k[i], lay.v[i]) for i in layers}
            heads = {i: local_full_precision_heads(heads[i], lay.k[i], lay.v[i], i, lay.rank) if heads[i] else ()
                     for i in layers}
        # per layer its parameters (the INT2 heads' rotations, clips, the split into INT2 and retrieval heads: the
        # generate cache's LayerParams)
        self.params = {i: LayerParams.build(config, rots[i], i, self.num_kv_heads, heads[i], self.device)
                       for i in layers}
        self._rotations_cpu = rots
        self.requests: dict[str, RequestKV] = {}
        self.windows = WindowPool(max_requests, len(layers), self.num_kv_heads, config.sink + self.ring, fp.head_dim,
                                  dtype, self.device)
        if prompt_budget is None:
            prompt_budget = getattr(model_config.get_text_config(decoder=True), "max_position_embeddings", None)
            if prompt_budget is None:
                raise ValueError("the model config has no max_position_embeddings: give prompt_budget= (tokens of "
                                 "prompts held in full precision at once while they arrive in chunks)")
        if not isinstance(prompt_budget, int) or isinstance(prompt_budget, bool) or prompt_budget < 1:
            raise ValueError(f"prompt_budget must be a positive number of tokens, got {prompt_budget!r}")
        self.prompt_budget = prompt_budget
        self._warned_prompt = False
        self._plan: DecodePlan | None = None
        self._buffers: DecodeBuffers | None = None
        self.graph_rows = 0  # CUDA graphs (enable_graphs): the most rows of a graphed decode step; 0 = off
        # the longest history a request is expected to reach (sizes the decode buffers' block tables; a longer one
        # takes fresh tensors, eagerly)
        self.max_positions = getattr(model_config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.pool: PagedInt2Pool | None = None
        self.pool_in_cache = False  # set by OscarPagedCache when the pool is laid out in Transformers' cache tensor
        self._deferred = defer_pool
        if defer_pool:
            if num_pages is not None or memory_budget is not None:
                raise ValueError("defer_pool=True: the pool is sized when attached; drop num_pages / memory_budget")
            return
        if num_pages is None:
            if memory_budget is None:
                raise ValueError("give the pool's size: num_pages= or memory_budget= (bytes), or defer_pool=True")
            num_pages = self.pages_in(int(memory_budget), page_size, min(DEFAULT_CHUNK_TOKENS, prompt_budget))
        elif memory_budget is not None:
            raise ValueError("pass num_pages= or memory_budget=, not both")
        self.attach_pool(num_pages, page_size)

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        """Layers the store quantizes."""
        return len(self.layer_slot)

    def _layout(self) -> dict:
        """Heads per pool layer in each form of a page (:class:`PagedInt2Pool`'s keywords)."""
        coded = [len(p.coded_heads) for p in self.params.values()]
        return dict(int2_heads=[self.num_kv_heads - c for c in coded], coded_heads=coded,
                    coded_bits=self.config.full_precision_bits, coded_dtype=self.dtype)

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of ``page_size`` history entries, keys and values of every quantized layer: the INT2 rows
        and the retrieval heads' coded rows."""
        return page_bytes(self.num_layers, self.num_kv_heads, self.head_dim, page_size, self.config.group_size,
                          self.config.torch_meta_dtype, **self._layout())

    def window_tokens(self) -> int:
        """Full-precision entries a request holds per layer: sink + ring."""
        return self.config.sink + self.ring

    def prompt_token_bytes(self) -> int:
        """Bytes a prompt token costs while its prompt arrives in chunks: its keys and values in every quantized layer,
        held in full precision until the prompt is complete (``RequestKV.prompt``, ``[1, Hk, T, D]`` per layer)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.windows.k.element_size()

    def prompt_transient_bytes(self, max_batch_tokens: int) -> int:
        """The most memory prompts arriving in chunks take beside the pages and windows: ``prompt_budget`` tokens held
        (:meth:`prompt_token_bytes`), plus one chunk call over the longest of them (one layer, ``T <= prompt_budget``
        keys; chunk of ``L <= max_batch_tokens`` rows): its keys and values repeated to the ``Hq`` query heads
        (``[1, Hq, T, D]`` each, what Transformers' sdpa hands SDPA) and its causal mask ``[L, T]`` in the model
        dtype. The concatenation that extends a layer's held chunks holds the old and the new ones of that layer for a
        moment, before the call: within the call's term (``Hq >= Hk``)."""
        t, a = self.prompt_budget, self.windows.k.element_size()
        call = t * (2 * self.num_query_heads * self.head_dim + min(max_batch_tokens, t)) * a
        return t * self.prompt_token_bytes() + call

    def reserved_bytes(self, max_batch_tokens: int) -> int:
        """What the store takes beside its page pool, at most: the windows of ``max_requests`` live requests and the
        prompt transient (:meth:`prompt_transient_bytes`). Sizing the pool from a memory budget reserves it."""
        return self.windows.reserved_bytes + self.prompt_transient_bytes(max_batch_tokens)

    def pages_in(self, budget: int, page_size: int, max_batch_tokens: int) -> int:
        """Pages of ``page_size`` entries that ``budget`` bytes pay for after :meth:`reserved_bytes`; at least one."""
        reserved = self.reserved_bytes(max_batch_tokens)
        pages = (budget - reserved) // self.page_bytes(page_size) - 1  # less the pool's trash page
        if pages < 1:
            raise ValueError(
                f"a memory budget of {budget} bytes does not pay for one page ({self.page_bytes(page_size)} bytes) "
                f"after the {self.windows.num_slots} windows ({self.windows.reserved_bytes} bytes) and the prompt "
                f"budget ({self.prompt_budget} tokens in full precision: "
                f"{self.prompt_transient_bytes(max_batch_tokens)} bytes): lower max_requests or prompt_budget, or "
                "raise the budget")
        return pages

    def history_pages(self, length: int, page_size: int) -> int:
        """INT2 pages a request of ``length`` tokens holds: its history entries ``[S0, length - W)``."""
        n = length - self.config.sink - self.config.recent
        return -(-n // page_size) if n > 0 else 0

    def attach_pool(self, num_pages: int, page_size: int, storage: torch.Tensor | None = None) -> PagedInt2Pool:
        """(Re)build the page pool: ``num_pages`` pages of ``page_size`` entries, in ``storage`` (flat uint8, see
        :class:`PagedInt2Pool`) or in tensors of its own. Only while no request is live."""
        if self.requests:
            raise RuntimeError(f"the store still holds {len(self.requests)} requests; free them before a new pool")
        self.pool = PagedInt2Pool(num_pages, self.num_layers, self.num_kv_heads, self.head_dim, page_size,
                                  self.config.group_size, self.config.torch_meta_dtype, self.device, storage=storage,
                                  trash_page=True, **self._layout())
        self._buffers = None  # sized for this pool's pages
        return self.pool

    def enable_graphs(self, rows: int) -> None:
        """Make the decode step graph-safe for steps of up to ``rows`` rows (a CUDA-graph manager's padded batch):
        the window slots are allocated now with a trash slot (:meth:`WindowPool.fix`: their addresses never change
        after a capture) and the decode buffers take ``rows`` rows. Before the manager sizes its cache: the trash
        slot is in :meth:`reserved_bytes`."""
        self.graph_rows = rows
        self.windows.with_trash = True
        self._buffers = None

    def check_pool_sizing(self, follows_blocks: bool) -> None:
        """Who sizes the page pool: Transformers' blocks when the store quantizes every layer (``follows_blocks``),
        else the user (Transformers keeps its BF16 cache for the other layers)."""
        if not follows_blocks and not self.has_pool:
            raise ValueError("this model has layers OSCAR does not quantize (sliding windows / skip_layers): its BF16 "
                             "paged cache stays and the INT2 pool is sized apart: give num_pages= or memory_budget=")
        if follows_blocks and not self._deferred:
            raise ValueError("the INT2 pool follows Transformers' blocks for this model: size it with "
                             "ContinuousBatchingConfig(num_blocks= / max_memory_percent=), not num_pages= / "
                             "memory_budget=")

    # ------------------------------------------------------------------ requests
    def handles(self, layer_idx: int) -> bool:
        return layer_idx in self.layer_slot

    def length(self, request_id: str) -> int:
        r = self.requests.get(request_id)
        return 0 if r is None else r.length()

    def can_reserve(self) -> bool:
        return self.windows.num_free > 0

    @property
    def prompt_reserved(self) -> int:
        """Prompt tokens reserved now (:meth:`admit_prompt`), at most ``prompt_budget``."""
        return sum(r.prompt_reserved for r in self.requests.values())

    def prompt_hold(self, request_id: str, prompt_len: int, split: bool) -> int:
        """Tokens of ``prompt_budget`` that admitting this step's chunk of ``request_id`` needs: its whole prompt
        (``prompt_len`` tokens) when the scheduler splits it and it has no reservation yet, else 0."""
        r = self.requests.get(request_id)
        if not split or (r is not None and r.prompt_reserved):
            return 0
        return prompt_len

    def can_hold(self, tokens: int) -> bool:
        """Whether ``tokens`` more prompt tokens fit the budget now. A prompt longer than the whole budget never
        will: it is admitted without a reservation (its chunks are not kept, see :meth:`admit_prompt`)."""
        return tokens > self.prompt_budget or self.prompt_reserved + tokens <= self.prompt_budget

    def admit_prompt(self, request_id: str, tokens: int) -> None:
        """Reserve ``tokens`` of ``prompt_budget`` for ``request_id``'s chunks (the scheduler's admission, after
        :meth:`can_hold`), given back when it decodes or leaves. A prompt longer than the whole budget gets none: its
        later chunks attend to its INT2 history, as a long prompt through ``generate(prefill_chunk_size=...)`` does,
        so its tokens depend on how the scheduler split it (logged once)."""
        r = self.reserve(request_id)
        if tokens > self.prompt_budget:
            if not self._warned_prompt:
                self._warned_prompt = True
                logger.warning("a prompt of %d tokens arrives in chunks but prompt_budget is %d tokens: its later "
                               "chunks attend to the INT2 history of the earlier ones (raise prompt_budget to keep "
                               "them exact)", tokens, self.prompt_budget)
            return
        if self.prompt_reserved + tokens > self.prompt_budget:
            raise RuntimeError(f"prompt budget exceeded: {self.prompt_reserved} + {tokens} > {self.prompt_budget} "
                               "tokens (admit only after can_hold)")
        r.prompt_reserved = tokens

    def reserve(self, request_id: str) -> RequestKV:
        """The request's entry (a window slot taken now if it has none: admission)."""
        r = self.requests.get(request_id)
        if r is None:
            r = self.requests[request_id] = RequestKV(self.windows.allocate(), [], {})
        return r

    def note_prompt(self, request_id: str, more: bool | None) -> None:
        """The scheduler's word for this step: ``request_id``'s prompt has more chunks to come (True), ends with this
        step's (False), or None (not known). Decides whether its chunks stay in full precision (:class:`RequestKV`)."""
        r = self.requests.get(request_id)
        if r is not None:
            r.prompt_more = more

    def free(self, request_id: str) -> None:
        """The request leaves: its window slot and pages go back (shared pages when their last holder leaves)."""
        r = self.requests.pop(request_id, None)
        if r is not None:
            for page in r.table:
                self.pool.release(page)
            self.windows.release(r.slot)

    def free_all(self) -> None:
        for rid in list(self.requests):
            self.free(rid)

    def release_memory(self) -> None:
        """Every request leaves and the memory goes back: the window slots, and a page pool that lives in a
        continuous-batching manager's cache tensor or was sized by it (``defer_pool``); a pool the caller sized
        (``num_pages`` / ``memory_budget``) stays. What a stopping manager calls (:mod:`~oscar_hf.serving.batching`);
        the next manager attaches a new pool."""
        self.free_all()
        self.windows.release_memory()
        if self._deferred and self.has_pool:
            self.pool.release_storage()
            self.pool_in_cache = False

    @property
    def has_pool(self) -> bool:
        """Whether the store has a page pool to serve from (attached, and its memory not given back)."""
        return self.pool is not None and not self.pool.released

    def _request(self, request_id: str, layer_idx: int, past_length: int, new_k: torch.Tensor) -> RequestKV:
        if not self.has_pool:
            raise RuntimeError("the OSCAR store has no page pool (defer_pool=True and no attach_pool, or its manager "
                               "stopped and gave the pool's memory back)")
        r = self.requests.get(request_id)
        if (r is None or layer_idx not in r.lengths) and past_length != 0:
            raise NotImplementedError(
                f"request {request_id!r} starts at position {past_length}: its first {past_length} tokens were never "
                "written to the OSCAR store (prefix sharing or a CPU-offload restore, which it does not follow)")
        if r is None:
            r = self.reserve(request_id)
        if layer_idx not in r.lengths:
            check_first_keys(layer_idx, self._rotations_cpu[layer_idx], new_k)
            if new_k.dtype != self.dtype or new_k.device != self.device:
                raise ValueError(f"the OSCAR store holds {self.dtype} on {self.device}, got {new_k.dtype} on "
                                 f"{new_k.device}")
            r.lengths[layer_idx] = 0
        if r.lengths[layer_idx] != past_length:
            raise RuntimeError(f"request {request_id!r} layer {layer_idx}: the store holds {r.lengths[layer_idx]} "
                               f"tokens, the batch says {past_length}")
        return r

    def _pages_for(self, r: RequestKV, entries: int) -> None:
        """Pages for history entries ``[0, entries)`` (the first layer to need one takes it for all layers)."""
        need = -(-entries // self.pool.page_size)
        while len(r.table) < need:
            r.table.append(self.pool.allocate())

    # ------------------------------------------------------------------ one forward of a batch
    def attend(self, layer_idx: int, query: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, batch,
               scaling: float, module, base: str) -> torch.Tensor:
        """``[1, Q, Hq, D]``: one layer of a packed forward. ``query [1, Hq, Q, D]``, ``new_k/new_v [1, Hk, Q, D]``,
        ``batch`` the requests in packing order as ``(request_id, past_length, L_i)`` (``sum L_i <= Q``: rows past
        them pad the batch to a CUDA-graph size and get 0); each request's rows attend to its own cache and new rows
        (causal), which are then stored. The decode rows read the step's :class:`DecodePlan`
        (:meth:`plan_decode`, made here by the first layer when no prepare hook made it before the forward)."""
        total = sum(q for _, _, q in batch)
        if total > query.shape[2] or new_k.shape[2] != query.shape[2]:
            raise RuntimeError(f"OSCAR paged attention: the batch holds {total} new tokens, the query "
                               f"{query.shape[2]}, the keys {new_k.shape[2]}")
        plan = self._plan
        if plan is None or plan.key != tuple(batch):
            plan = self.plan_decode(batch)
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
            out[0, plan.pos] = self._decode(layer_idx, plan, query, new_k, new_v, scaling)
        return out

    # ------------------------------------------------------------------ decode rows, batched
    def plan_decode(self, batch, rows: int | None = None) -> DecodePlan | None:
        """The decode rows' plan of the forward that packs ``batch`` (host work, before the forward: Transformers'
        prepare hooks, :meth:`OscarPagedCache.prepare_forward`): window slots and ring entries, the page and offset
        each row demotes slot ``T - 1 - W`` to (pages allocated here), block tables, history lengths, window masks,
        written into the fixed :class:`DecodeBuffers`. The requests' token counts advance here, in every layer at
        once, so the forward itself updates no host state (a graph replay runs none). ``rows``: the forward's
        padded row count when the step may be CUDA-graphed (graphs enabled, every row of ``batch`` a decode row, and
        it fits the buffers): the padded rows then point to the trash window slot and the trash page, and
        ``max_hist`` is the bucket (:func:`history_bucket`). None when ``batch`` has no decode row."""
        decode = [i for i, (_, past, q) in enumerate(batch) if q == 1 and past > 0]
        if not decode:
            self._plan = None
            return None
        if not self.has_pool:
            raise RuntimeError("the OSCAR store has no page pool (defer_pool=True and no attach_pool, or its manager "
                               "stopped and gave the pool's memory back)")
        s0, w, ring, p = self.config.sink, self.config.recent, self.ring, self.pool.page_size
        trash_page = self.pool.trash_page
        graphed = (rows is not None and self.graph_rows > 0 and len(decode) == len(batch)
                   and len(decode) <= rows <= self.graph_rows and self.windows.trash_slot is not None)
        offsets = [0]
        for _, _, q in batch:
            offsets.append(offsets[-1] + q)
        fields = {f: [] for f in DecodeBuffers.FIELDS}
        tables, hist, requests = [], [], []
        for i in decode:
            rid, t, _ = batch[i]
            r = self.requests.get(rid)
            if r is None or not r.lengths:  # never written: prefix sharing or an offload restore (refused there)
                self._request(rid, next(iter(self.layer_slot)), t, None)
            if any(n != t for n in r.lengths.values()):
                raise RuntimeError(f"request {rid!r}: the store holds {None if r is None else r.lengths} tokens per "
                                   f"layer, the batch says {t}")
            e = t - 1 - w - s0  # history entry of slot T - 1 - W, which left the window at the previous step
            if e >= 0:
                self._pages_for(r, e + 1)
            new_entry = s0 + t % ring
            for f, x in zip(DecodeBuffers.FIELDS, (
                    offsets[i], r.slot, new_entry, t if t < s0 else new_entry, s0 + (t - 1 - w) % ring,
                    r.table[e // p] if e >= 0 else trash_page, e % p if e >= 0 else 0, t)):
                fields[f].append(x)
            hist.append(max(t - w - s0, 0))
            tables.append(r.table)
            requests.append((rid, t))
        if graphed:  # the padded rows: the trash slot (t = -1: nothing valid in its window), the trash page
            for k in range(len(decode), rows):
                for f, x in zip(DecodeBuffers.FIELDS, (k, self.windows.trash_slot, s0, s0, s0, trash_page, 0, -1)):
                    fields[f].append(x)
                hist.append(0)
                tables.append([])
        max_hist = history_bucket(max(hist), p) if graphed else max(hist)
        cols = max(1, -(-max_hist // p))
        bp = len(fields["pos"])
        # on the host, through numpy (3x faster than torch.tensor from lists: ~80 us for 24 rows x 128 pages)
        index = torch.from_numpy(np.array([fields[f] for f in DecodeBuffers.FIELDS], dtype=np.int64))  # [8, Bp]
        # [Bp, cols] block tables, -1 past a row's pages
        table = torch.from_numpy(np.array([tb[:cols] + [-1] * (cols - min(len(tb), cols)) for tb in tables],
                                          dtype=np.int32))
        buf = self._decode_buffers(bp, cols)
        if buf is None:  # outgrew the buffers: fresh tensors, eagerly
            graphed = False
            buf = DecodeBuffers(bp, cols, s0 + ring, self.device)
        idx = buf.index[:, :bp]
        idx.copy_(index)
        bt = buf.table[:bp, :cols]
        bt.copy_(table)
        hl = buf.hist_len[:bp]
        hl.copy_(torch.tensor(hist, dtype=torch.int32))
        wm = buf.win_mask[:bp]
        # the new token, the W before it and the sink; computed on the host: every write here is a synchronous copy,
        # complete before the forward starts on Transformers' compute stream (a device op here would race with it)
        wm.copy_(window_mask(index[7] + 1, 0, s0, ring, w + 1))
        pos, slots, new_entry, sink_entry, dem_entry, dem_page, dem_off, _ = idx.unbind(0)
        ts = fields["t"][: len(decode)]
        self._plan = DecodePlan(
            key=tuple(batch), pos=pos, slots=slots, new_entry=new_entry, sink_entry=sink_entry,
            demote_entry=dem_entry, demote_page=dem_page, demote_off=dem_off, block_table=bt, hist_len=hl,
            hist_start=buf.hist_start[:bp], win_mask=wm, max_hist=max_hist,
            write_sink=graphed or min(ts) < s0, demote=graphed or max(ts) > w + s0, graphable=graphed,
            requests=requests)
        for rid, t in requests:  # the step's writes are planned: every layer holds T + 1 tokens after the forward
            r = self.requests[rid]
            r.lengths = dict.fromkeys(r.lengths, t + 1)
            r.prompt.clear()  # decoding: the prompt is complete, its full-precision chunks go
            r.prompt_reserved = 0
        return self._plan

    def _decode_buffers(self, rows: int, cols: int) -> DecodeBuffers | None:
        """The fixed buffers if a step of ``rows`` x ``cols`` fits them (allocated at the first step: ``max_requests``
        rows, or the graphed step's ``graph_rows``; the block tables as wide as the model's longest history or the
        pool, whichever is less), else None. Never reallocated while graphs may hold them."""
        if self._buffers is None:
            most = self.pool.num_pages
            if self.max_positions:
                most = min(most, max(1, self.history_pages(self.max_positions, self.pool.page_size)))
            self._buffers = DecodeBuffers(max(self.windows.num_slots, self.graph_rows), most,
                                          self.config.sink + self.ring, self.device)
        b = self._buffers
        return b if rows <= b.rows and cols <= b.cols else None

    def _decode(self, layer_idx: int, plan: DecodePlan, query, new_k, new_v, scaling: float) -> torch.Tensor:
        """``[Bp, Hq, D]``: write then read one token for each row of ``plan`` (see the module docstring). Device
        work only, its shapes set by the plan's row count and ``max_hist``: no host synchronization, so a CUDA graph
        may capture it and replay it with the next step's plan in the same buffers."""
        cfg, li, p = self.config, self.layer_slot[layer_idx], self.params[layer_idx]
        win_k, win_v = self.windows.k[:, li], self.windows.v[:, li]  # [slots, Hk, S0 + R, D]
        # 1-2. the write, one launch on CUDA: slot T - 1 - W leaves the ring for the row's current page (or the trash
        # page) as INT2 and coded rows, then the new token goes to its ring entry (the one just demoted: R = W + 1)
        # and its sink entry while T < S0
        pool = self.pool
        coded = (CodedSlots(pool.coded_rows(li, "k"), pool.coded_rows(li, "v"), p.coded_of, p.bits)
                 if p.coded_heads else None)
        paged_append(new_k[0], new_v[0], win_k, win_v, pool.rows(li, "k"), pool.rows(li, "v"), plan.write_rows,
                     p.hist_of, p.r_k, p.mu_k, p.clip_k, p.r_v, p.mu_v, p.clip_v, cfg.group_size, cfg.torch_meta_dtype,
                     demote=plan.demote, write_sink=plan.write_sink, use_kernels=cfg.use_kernels,
                     quantizer=cfg.quantizer, coded=coded)
        # 3. read: history pages through the block tables + the window slots
        q = group_queries(query[0].index_select(1, plan.pos).transpose(0, 1)[:, :, None], self.num_kv_heads)
        if not p.coded_heads:
            out = self._decode_int2(layer_idx, plan, q, win_k, win_v, plan.slots, scaling)  # [Bp, Hk, g, D]
        else:  # the rows' windows gathered once ([Bp, Hk, S0 + R, D]): each part reads its heads of them
            wk, wv = win_k.index_select(0, plan.slots), win_v.index_select(0, plan.slots)
            rows = torch.arange(plan.rows, device=self.device)
            part = None
            if p.int2_heads:
                part = self._decode_int2(layer_idx, plan, p.int2_part(q), p.int2_part(wk), p.int2_part(wv), rows,
                                         scaling)
            # the retrieval heads: their coded pages read in place through the block tables, the exact window
            coded = heads_decode_attention(q, p.coded_idx, self.pool.coded_rows(li, "k"),
                                           self.pool.coded_rows(li, "v"), p.bits, plan.hist_start, plan.hist_len,
                                           wk, wv, plan.win_mask, scaling, query.dtype,
                                           use_kernels=self.config.use_kernels, block_table=plan.block_table,
                                           max_len=plan.max_hist)
            out = p.merge(part, coded.to(query.dtype))
        return out.reshape(plan.rows, query.shape[1], query.shape[3])

    def _decode_int2(self, layer_idx: int, plan: DecodePlan, q, win_k, win_v, win_slot, scaling: float):
        """``[Bd, Hq_l, g, D]``: the INT2 heads' read, ``q [Bd, Hq_l, g, D]`` (model dtype) over their pages and the
        windows ``win_k/v [slots, Hq_l, S0 + R, D]`` (row ``b`` at slot ``win_slot[b]``)."""
        cfg, p, li = self.config, self.params[layer_idx], self.layer_slot[layer_idx]
        return paged_decode_attention(q.float(), p.r_k, p.mu_k, self.pool.rows(li, "k"), self.pool.rows(li, "v"),
                                      plan.block_table, plan.hist_len, win_k, win_v, win_slot, plan.win_mask, p.r_v,
                                      p.mu_v, scaling, cfg.group_size, q.dtype, use_kernels=cfg.use_kernels,
                                      max_hist_len=plan.max_hist)

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
        if t_old == 0:  # a new request: exactly the user's attention over its prompt
            out, _ = base_attention_function(module, base)(module, query, new_k, new_v, None, scaling=scaling,
                                                           dropout=0.0)
        elif exact:  # a later chunk of a prompt: exactly, over every earlier chunk
            k_all, v_all = torch.cat([earlier[0], new_k], 2), torch.cat([earlier[1], new_v], 2)  # [1, Hk, T + L, D]
            # the layer's held chunks are k_all from here: the earlier ones go before the attention call repeats K/V to
            # the query heads (both held only during the cat, within prompt_transient_bytes' call term)
            earlier = None
            row = t_old + torch.arange(l, device=query.device)[:, None]  # [L, 1] each new row's slot
            causal = torch.arange(t_old + l, device=query.device)[None, :] <= row  # [L, T + L]
            mask = torch.zeros(causal.shape, dtype=query.dtype, device=query.device).masked_fill(~causal, float("-inf"))
            out, _ = base_attention_function(module, base)(module, query, k_all, v_all, mask[None, None],
                                                           scaling=scaling, dropout=0.0)
        else:  # the history, the sink and the ring's slots [max(S0, T - W), T), then the new rows (causal)
            demote_pending(win_k, win_v, self._history(r, li, t_old - w), p, self.config, t_old)
            dev = query.device
            recent = torch.arange(min(t_old, max(s0, t_old - w)), t_old, device=dev)
            entries = torch.cat([torch.arange(min(t_old, s0), device=dev), ring_entries(recent, s0, self.ring)])
            k_win = torch.cat([win_k.index_select(2, entries), new_k], 2)  # [1, Hk, E + L, D]
            v_win = torch.cat([win_v.index_select(2, entries), new_v], 2)
            out = paged_chunk_attention(query, k_win, v_win, self.pool, r.table, li, max(t_old - w - s0, 0), p.r_k,
                                        p.mu_k, p.r_v, p.mu_v, scaling, p if p.coded_heads else None)
        # no padding: the request's sink is its slots [0, S0)
        commit(win_k, win_v, 0, self._history(r, li, t_old + l - w), p, self.config, t_old, new_k, new_v)
        r.lengths[layer_idx] = t_old + l
        # more of the prompt may come: it stays exact, within the request's reservation when a scheduler drives the
        # store (prompt_more known); without one (None) until the first decode step
        keep = r.prompt_more is None or (r.prompt_more and t_old + l <= r.prompt_reserved)
        if keep and (t_old == 0 or exact):
            r.prompt[li] = (k_all, v_all) if exact else (new_k.contiguous(), new_v.contiguous())
        return out

    def _history(self, r: RequestKV, li: int, end: int) -> PagedHistory:
        """Where request ``r``'s history entries of pool layer ``li`` live, with pages for the slots below ``end``
        (history entries ``[0, end - S0)``; the first layer to need a page takes it for all layers)."""
        self._pages_for(r, end - self.config.sink)
        return PagedHistory(self.pool, r.table, li)

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, int]:
        """Live requests, pages held and free, the bytes of the pages held (``history_bytes``: INT2 and coded rows;
        ``full_precision_heads_bytes``: the retrieval heads' share of them), of the window slots allocated now, and of
        the prompts arriving in chunks (``prompt_bytes``: their chunks so far, in full precision until the prompt is
        complete; ``prompt_tokens_reserved``: their share of ``prompt_budget``)."""
        pool = self.pool
        prompt = sum(x.numel() * x.element_size() for r in self.requests.values() for kv in r.prompt.values()
                     for x in kv)
        pages = pool.num_used if pool is not None else 0
        return dict(requests=len(self.requests), pages_used=pages, pages_free=pool.num_free if pool is not None else 0,
                    history_bytes=pages * pool.bytes_per_page if pool is not None else 0,
                    full_precision_heads_bytes=pages * pool.coded_bytes_per_page if pool is not None else 0,
                    window_slots_used=self.windows.num_slots - self.windows.num_free,
                    window_bytes=self.windows.nbytes, prompt_bytes=prompt, prompt_tokens_reserved=self.prompt_reserved)
