"""Prefix sharing and forks: requests whose prompts begin alike hold the same history pages, page ``b`` keyed by a hash
chain over tokens ``[0, S0 + (b+1)P)`` (docs/serving.md section 3, "Prefix sharing and forks")."""
from __future__ import annotations

import hashlib
from array import array


def shareable_pages(length: int, sink: int, recent: int, page_size: int) -> int:
    """History pages of a request of ``length`` tokens that no later step writes: entries below ``T - 1 - W - S0``
    (a decode step at ``T`` rewrites slot ``T - 1 - W`` from its window)."""
    return max(length - recent - 1 - sink, 0) // page_size


def _link(parent: int | None, tokens: list[int]) -> int:
    h = hashlib.blake2b(digest_size=8)  # not hash(): salted per process, and tensor-parallel ranks must agree
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class PrefixIndex:
    """Which live requests hold a page keyed by each hash chain link (module docstring)."""

    def __init__(self, sink: int, page_size: int):
        self.sink, self.page_size = sink, page_size
        self.holders: dict[int, dict[str, None]] = {}  # link -> the requests holding its page (an ordered set)
        self.links: dict[str, list[int]] = {}  # request -> its pages' links, in block-table order

    def _tokens(self, tokens: list[int], b: int) -> list[int]:
        """The tokens link ``b`` adds to its parent's."""
        s0, p = self.sink, self.page_size
        return tokens[: s0 + p] if b == 0 else tokens[s0 + b * p : s0 + (b + 1) * p]

    def register(self, request_id: str, tokens: list[int], pages: int) -> None:
        """``request_id``'s first ``pages`` pages hold ``tokens``' prefix (the pages it holds for good)."""
        links = self.links.setdefault(request_id, [])
        while len(links) < pages and len(tokens) >= self.sink + (len(links) + 1) * self.page_size:
            links.append(_link(links[-1] if links else None, self._tokens(tokens, len(links))))
            self.holders.setdefault(links[-1], {})[request_id] = None

    def match(self, tokens: list[int], max_pages: int) -> tuple[list[int], str | None]:
        """The links of the longest run of ``tokens``' pages (at most ``max_pages``) that a live request holds, and
        one such request (``([], None)``: none)."""
        links, holder = [], None
        while len(links) < max_pages:
            link = _link(links[-1] if links else None, self._tokens(tokens, len(links)))
            held = self.holders.get(link)
            if not held:
                break
            links.append(link)
            holder = next(iter(held))
        return links, holder

    def adopt(self, request_id: str, links: list[int]) -> None:
        """``request_id`` holds the pages of ``links`` too (it shares them)."""
        self.links[request_id] = list(links)
        for link in links:
            self.holders[link][request_id] = None

    def forget(self, request_id: str) -> None:
        for link in self.links.pop(request_id, ()):
            held = self.holders[link]
            held.pop(request_id, None)
            if not held:
                del self.holders[link]


class SharedPrefixes:
    """Prefix sharing and forks (a base of the store; ``prefixes`` is None when sharing is off)."""

    def shareable_pages(self, length: int) -> int:
        return shareable_pages(length, self.config.sink, self.config.recent, self.pool.page_size)

    def _fork_shares(self, source) -> int:
        """Pages of request ``source`` (a :class:`RequestKV`) a fork shares; it copies the rest of its table."""
        return min(self.shareable_pages(source.length()), len(source.table))

    def share_prefix(self, request_id: str, tokens: list[int]) -> tuple[int, str | None, int]:
        """Start a new request on the longest prefix of pages a live request holds: ``(m, holder, k)``, ``k`` pages
        covering its first ``m = S0 + kP`` tokens (``(0, None, 0)``: none, or no free window slot)."""
        r = self.requests.get(request_id)
        if self.prefixes is None or not self.has_pool or (r is not None and r.lengths):
            return 0, None, 0
        s0, w, p = self.config.sink, self.config.recent, self.pool.page_size
        links, holder = self.prefixes.match(tokens, max(len(tokens) - w - 2 - s0, 0) // p)
        if not links or not self.can_reserve(request_id):
            return 0, None, 0
        k, source = len(links), self.requests[holder]
        r = self.reserve(request_id)
        for page in source.table[:k]:
            self.pool.acquire(page)
        r.table = list(source.table[:k])
        for win in (self.windows.k, self.windows.v):  # [slots, L, Hk, S0 + R, D]: the sink, every layer
            win[r.slot, :, :, :s0] = win[source.slot, :, :, :s0]
        m = s0 + k * p
        r.lengths = dict.fromkeys(self.layer_slot, m)
        r.floor = m
        self.prefixes.adopt(request_id, links)
        return m, holder, k

    def index_pages(self, request_id: str, tokens: list[int]) -> None:
        """After a forward: offer ``request_id``'s final pages (``tokens``: prompt and generated) for sharing."""
        r = self.requests.get(request_id)
        if self.prefixes is not None and r is not None and r.lengths:
            self.prefixes.register(request_id, tokens, self.shareable_pages(r.length()))

    def fork(self, source_id: str, child_id: str) -> None:
        """Start ``child_id`` as a copy of ``source_id``: window copied, final pages shared, the others (at most two)
        copied."""
        s = self.requests[source_id]
        if child_id in self.requests:
            raise RuntimeError(f"fork: request {child_id!r} is already in the OSCAR store")
        r = self.reserve(child_id)
        k = self._fork_shares(s)
        for page in s.table[:k]:
            self.pool.acquire(page)
        copies = []
        for page in s.table[k:]:
            copies.append(self.pool.allocate())
            self.pool.copy_page(page, copies[-1])
        r.table = s.table[:k] + copies
        for win in (self.windows.k, self.windows.v):
            win[r.slot] = win[s.slot]
        r.lengths, r.floor = dict(s.lengths), s.floor
        if self.prefixes is not None and source_id in self.prefixes.links:
            self.prefixes.adopt(child_id, self.prefixes.links[source_id][:k])

    def fork_fits(self, source_id: str, children: int) -> int:
        """How many of ``children`` forks of ``source_id`` the store has window slots and pages for."""
        s = self.requests[source_id]
        copies = len(s.table) - self._fork_shares(s)
        by_pages = self.pool.num_free // copies if copies else children
        return max(0, min(children, self.windows.num_free, by_pages))
