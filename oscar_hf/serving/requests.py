"""Requests and memory of the paged store: window slots (:class:`WindowPool`), one request's entry
(:class:`RequestKV`), and the store's sizes, admission and accounting (:class:`StoreRequests`, a base of the store)."""
from __future__ import annotations

import dataclasses
import logging

import torch

from ..cache.base import check_first_keys
from .pool import HeadLayout, PagedInt2Pool, PoolExhausted, page_bytes
from .prefix import PrefixIndex

logger = logging.getLogger("oscar_hf")


class WindowPool:
    """Full-precision windows of up to ``num_slots`` live requests, ``k, v [capacity, L, Hk, S0 + R, D]`` (model
    dtype), and a free list of slots (docs/serving.md section 3, "Windows")."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, entries: int, head_dim: int,
                 dtype: torch.dtype, device):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"the window pool needs at least one slot, got max_requests={num_slots!r}")
        self.slot_shape = (num_layers, num_kv_heads, entries, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.num_slots = num_slots  # the most live requests (admission's limit)
        self.k = self.v = torch.empty((0, *self.slot_shape), dtype=dtype, device=self.device)
        self._free: list[int] = []  # allocated slots nobody holds (but those kept: release(keep=True))
        self._held = 0
        self.reclaim = None  # () -> None: evicts a retained page (the store's pool), in the end freeing a kept slot
        # CUDA graphs (allocate_all(trash=True)): one trash slot, k / v's last row, for a graphed step's padded rows
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

    def allocate_all(self, trash: bool = False) -> None:
        """Allocate every slot now (and the trash slot, with ``trash``), keeping the live ones."""
        trash = trash or self.trash_slot is not None
        if self.capacity < self.num_slots or (trash and self.trash_slot is None):
            self.with_trash = self.with_trash or trash
            self._grow(self.num_slots, trash=trash)

    def allocate(self, slot: int | None = None) -> int:
        """A free slot (a kept one taken back if none is), or kept ``slot`` itself."""
        if self._held == self.num_slots:
            raise PoolExhausted(f"all {self.num_slots} window slots are taken: raise max_requests")
        while slot is None and not self._free:
            self._grow() if self.capacity < self.num_slots else self.reclaim()
        self._held += 1
        return self._free.pop() if slot is None else slot

    def release(self, slot: int, keep: bool = False, held: bool = True) -> None:
        """``slot`` goes back, or (``keep``) is kept, neither held nor free, for a retained prefix's sink; ``held``:
        False for a kept slot going back."""
        if not keep:
            self._free.append(slot)
        self._held -= held

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
    """One live request: window slot, block table (shared by its layers), tokens each layer has stored. ``prompt``:
    per pool layer the prompt's chunks in full precision (``[1, Hk, T, D]`` keys and values) while more may come
    (``prompt_more``; None: not known), within its ``prompt_reserved`` share of ``prompt_budget``."""

    slot: int
    table: list[int]
    lengths: dict[int, int]
    prompt: dict = dataclasses.field(default_factory=dict)
    prompt_more: bool | None = None
    prompt_reserved: int = 0
    floor: int = 0  # slots below it are history whatever the window: a shared prefix's (oscar_hf.serving.prefix)

    def length(self) -> int:
        return max(self.lengths.values(), default=0)


class StoreRequests:
    """The store's sizes, requests and accounting (a base of :class:`~oscar_hf.serving.store.OscarPagedStore`)."""

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        """Layers the store quantizes."""
        return len(self.layer_slot)

    def _layout(self) -> HeadLayout:
        """Heads per pool layer in each form of a page."""
        coded = [len(p.coded_heads) for p in self.params.values()]
        return HeadLayout([self.num_kv_heads - c for c in coded], coded, self.config.retrieval_bits, self.dtype,
                          self.config.key_bits, self.config.value_group(self.head_dim))

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of ``page_size`` history entries, keys and values, of every quantized layer."""
        return page_bytes(self.num_layers, self.num_kv_heads, self.head_dim, page_size, self.config.group_size,
                          self.config.torch_meta_dtype, self._layout())

    def prompt_token_bytes(self) -> int:
        """Bytes a prompt token costs while held in full precision (``RequestKV.prompt``), over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.windows.k.element_size()

    def prompt_transient_bytes(self, max_batch_tokens: int) -> int:
        """The most chunked prompts take beside pages and windows: ``prompt_budget`` tokens held, plus one chunk call
        over the longest (``[1, Hq, T, D]`` keys and values repeated to the query heads, an ``[L, T]`` mask)."""
        t, a = self.prompt_budget, self.windows.k.element_size()
        call = t * (2 * self.num_query_heads * self.head_dim + min(max_batch_tokens, t)) * a
        return t * self.prompt_token_bytes() + call

    def reserved_bytes(self, max_batch_tokens: int) -> int:
        """The most the store takes beside its page pool (windows and prompt transient); sizing reserves it."""
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
        return -(-max(length - self.config.sink - self.config.recent, 0) // page_size)

    def attach_pool(self, num_pages: int, page_size: int, storage: torch.Tensor | None = None) -> None:
        """(Re)build the page pool, in ``storage`` (flat uint8) or its own tensors; only while no request is live."""
        if self.requests:
            raise RuntimeError(f"the store still holds {len(self.requests)} requests; free them before a new pool")
        self.drop_retained()
        self.pool = PagedInt2Pool(num_pages, self.num_layers, self.num_kv_heads, self.head_dim, page_size,
                                  self.config.group_size, self.config.torch_meta_dtype, self.device, storage=storage,
                                  trash_page=True, layout=self._layout())
        self.prefixes = PrefixIndex(self.config.sink, page_size) if self.prefix_sharing else None
        self.pool.evicted, self.windows.reclaim = self._evicted, self.pool.evict
        self._buffers = None  # sized for this pool's pages

    def enable_graphs(self, rows: int) -> None:
        """Make the decode step graph-safe for steps of up to ``rows`` rows; before the manager sizes its cache (the
        trash slot counts in :meth:`reserved_bytes`)."""
        self.graph_rows = rows
        self.windows.with_trash = True
        self._buffers = None

    # ------------------------------------------------------------------ requests
    def handles(self, layer_idx: int) -> bool:
        return layer_idx in self.layer_slot

    def length(self, request_id: str) -> int:
        r = self.requests.get(request_id)
        return 0 if r is None else r.length()

    @property
    def prompt_reserved(self) -> int:
        """Prompt tokens reserved now, at most ``prompt_budget``."""
        return sum(r.prompt_reserved for r in self.requests.values())

    def can_reserve(self, request_id: str | None = None, hold: int = 0) -> bool:
        """Whether :meth:`reserve` can take the request now (None: a new one): a window slot if it has none, and
        ``hold`` prompt tokens within ``prompt_budget`` (a prompt longer than the budget reserves none)."""
        if request_id not in self.requests and not self.windows.num_free:
            return False
        return hold > self.prompt_budget or self.prompt_reserved + hold <= self.prompt_budget

    def reserve(self, request_id: str, hold: int = 0, slot: int | None = None) -> RequestKV:
        """The request's entry, a window slot taken now if it has none (admission; ``slot``: that kept slot), and
        ``hold`` tokens of ``prompt_budget`` (after :meth:`can_reserve`) until it decodes or leaves. A prompt longer
        than the budget gets none: its later chunks attend to its INT2 history (logged once)."""
        r = self.requests.get(request_id)
        if r is None:
            r = self.requests[request_id] = RequestKV(self.windows.allocate(slot), [], {})
        if hold > self.prompt_budget:
            if not self._warned_prompt:
                self._warned_prompt = True
                logger.warning("a prompt of %d tokens arrives in chunks but prompt_budget is %d tokens: its later "
                               "chunks attend to the INT2 history of the earlier ones (raise prompt_budget to keep "
                               "them exact)", hold, self.prompt_budget)
        elif hold:
            if self.prompt_reserved + hold > self.prompt_budget:
                raise RuntimeError(f"prompt budget exceeded: {self.prompt_reserved} + {hold} > {self.prompt_budget} "
                                   "tokens (reserve only after can_reserve)")
            r.prompt_reserved = hold
        return r

    def free(self, request_id: str) -> None:
        """The request leaves: its window slot and pages go back (shared pages when their last holder leaves; indexed
        pages no request holds then are retained, with ``retain_prefixes``: :meth:`SharedPrefixes._leave`)."""
        r = self.requests.pop(request_id, None)
        links = self.prefixes.forget(request_id) if self.prefixes is not None else []
        if r is not None:
            self._leave(r, links if self.retain_prefixes else [])

    def free_all(self) -> None:
        for rid in list(self.requests):
            self.free(rid)

    def release_memory(self) -> None:
        """A stopping manager's call: every request leaves; the window slots and a manager-sized pool (``defer_pool``)
        give their memory back (a pool the caller sized stays)."""
        self.free_all()
        self.drop_retained()
        self.windows.release_memory()
        if self._deferred and self.has_pool:
            self.pool.release_storage()

    @property
    def has_pool(self) -> bool:
        """Whether the store has a page pool to serve from (attached, and its memory not given back)."""
        return self.pool is not None and not self.pool.released

    def _need_pool(self) -> None:
        if not self.has_pool:
            raise RuntimeError("the OSCAR store has no page pool (defer_pool=True and no attach_pool, or its manager "
                               "stopped and gave the pool's memory back)")

    def _request(self, request_id: str, layer_idx: int, past_length: int, new_k: torch.Tensor) -> None:
        self._need_pool()
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

    def _pages_for(self, r: RequestKV, entries: int) -> None:
        """Pages for history entries ``[0, entries)`` (the first layer to need one takes it for all layers)."""
        need = -(-entries // self.pool.page_size)
        while len(r.table) < need:
            r.table.append(self.pool.allocate())

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, int]:
        """Live requests; pages used, free (retained ones included), shared and retained; bytes of the pages held
        (``retrieval_heads_bytes``: the retrieval heads' share), of the window slots and of the prompt chunks held;
        prompt tokens reserved."""
        pool = self.pool
        prompt = sum(x.numel() * x.element_size() for r in self.requests.values() for kv in r.prompt.values()
                     for x in kv)
        pages, free, shared, retained, page, coded = (0,) * 6 if pool is None else (
            pool.num_used, pool.num_free, pool.num_shared, len(pool.retained), pool.bytes_per_page,
            pool.coded_bytes_per_page)
        return dict(requests=len(self.requests), pages_used=pages, pages_free=free, pages_shared=shared,
                    pages_retained=retained, history_bytes=pages * page, retrieval_heads_bytes=pages * coded,
                    window_slots_used=self.windows.num_slots - self.windows.num_free,
                    window_bytes=self.windows.nbytes, prompt_bytes=prompt, prompt_tokens_reserved=self.prompt_reserved)
