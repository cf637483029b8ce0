"""Prefix sharing and forks: requests whose prompts begin alike hold the same history pages, page ``b`` keyed by a hash
chain over tokens ``[0, S0 + (b+1)P)``; indexed pages no request holds any more are retained until the pool needs them
(docs/serving.md section 3, "Prefix sharing and forks")."""
from __future__ import annotations

import hashlib
import itertools
import operator
from array import array


class PrefixIndex:
    """Which live requests hold a page keyed by each hash chain link, and which retained page keeps a link no live
    request holds (module docstring)."""

    def __init__(self, sink: int, page_size: int):
        self.sink, self.page_size = sink, page_size
        self.holders: dict[int, dict[str, None]] = {}  # link -> the requests holding its page (an ordered set)
        self.links: dict[str, list[int]] = {}  # request -> its pages' links, in block-table order
        self.kept: dict[int, int] = {}  # link -> its retained page (the pool's retained set, in the pool's order)
        self.sinks: dict[int, int] = {}  # a kept first page's link -> the window slot kept with it (the sink's rows)
        self.tokens: dict[str, list[int]] = {}  # request -> its tokens when it last offered pages

    def _next_link(self, links: list[int], tokens: list[int]) -> int:
        """The chain's link after ``links``: page ``len(links)`` of ``tokens`` (its parent's link and its tokens)."""
        b, s0, p = len(links), self.sink, self.page_size
        h = hashlib.blake2b(digest_size=8)  # not hash(): salted per process, and tensor-parallel ranks must agree
        if links:
            h.update(links[-1].to_bytes(8, "little"))
        first = s0 + b * p if b else 0  # page 0's link covers the sink's tokens too
        h.update(array("q", tokens[first : s0 + (b + 1) * p]).tobytes())
        return int.from_bytes(h.digest(), "little")

    def register(self, request_id: str, tokens: list[int], pages: int) -> None:
        """``request_id``'s first ``pages`` pages hold ``tokens``' prefix (the pages it holds for good)."""
        links, self.tokens[request_id] = self.links.setdefault(request_id, []), tokens
        while len(links) < pages and len(tokens) >= self.sink + (len(links) + 1) * self.page_size:
            links.append(self._next_link(links, tokens))
            self.holders.setdefault(links[-1], {})[request_id] = None

    def match(self, tokens: list[int], max_pages: int) -> tuple[list[int], str | None]:
        """The links of the longest run of ``tokens``' pages (at most ``max_pages``), those a live request holds, then
        those kept; and a live request holding the first ones (``([], None)``: none)."""
        links, holder, live = [], None, True
        while len(links) < max_pages:
            link = self._next_link(links, tokens)
            held = self.holders.get(link) if live else None
            if held:
                holder = next(iter(held))
            elif link in self.kept:
                live = False
            else:
                break
            links.append(link)
        return links, holder

    def adopt(self, request_id: str, links: list[int]) -> None:
        """``request_id`` holds the pages of ``links`` too (it shares them)."""
        self.links[request_id] = list(links)
        for link in links:
            self.holders.setdefault(link, {})[request_id] = None

    def forget(self, request_id: str) -> list[int | None]:
        """``request_id`` leaves: its links, None for those a live request still holds."""
        links = self.links.pop(request_id, [])
        self.tokens.pop(request_id, None)
        for link in links:
            held = self.holders[link]
            held.pop(request_id, None)
            if not held:
                del self.holders[link]
        return [None if link in self.holders else link for link in links]


class SharedPrefixes:
    """Prefix sharing and forks (a base of the store; ``prefixes`` is None when sharing is off)."""

    def shareable_pages(self, length: int) -> int:
        """History pages of a request of ``length`` tokens that no later step writes: entries below ``T - 1 - W - S0``
        (a decode step at ``T`` rewrites slot ``T - 1 - W`` from its window)."""
        return max(length - self.config.recent - 1 - self.config.sink, 0) // self.pool.page_size

    def _fork_shares(self, source) -> int:
        """Pages of request ``source`` (a :class:`RequestKV`) a fork shares; it copies the rest of its table."""
        return min(self.shareable_pages(source.length()), len(source.table))

    def share_prefix(self, request_id: str, tokens: list[int]) -> tuple[int, str | None, int]:
        """Start a new request on the longest prefix a live request holds in its pages and window
        (:meth:`_join_window`), else of pages a live request holds or the index keeps: ``(m, holder, k)``, its first
        ``m`` tokens taken (``S0 + kP`` from pages alone), ``k`` pages, the first ones ``holder``'s (None: all were
        kept) (``(0, None, 0)``: none, or no free window slot)."""
        r, (room, self.share_room) = self.requests.get(request_id), (self.share_room, None)
        if self.prefixes is None or not self.has_pool or (r is not None and r.lengths):
            return 0, None, 0
        s0, w, p, index = self.config.sink, self.config.recent, self.pool.page_size, self.prefixes
        links, holder = index.match(tokens, max(len(tokens) - w - 2 - s0, 0) // p)
        live = len(list(itertools.takewhile(index.holders.__contains__, links)))
        links = links if room is None else links[: live + room]
        near = self._window_source(tokens) if room is None or room > 0 else None
        if near and near[1] > s0 + len(links) * p and self.can_reserve(request_id):
            return self._join_window(request_id, *near)
        if not links or not self.can_reserve(request_id):
            return 0, None, 0
        table = (self.requests[holder].table[:live] if live else []) + [index.kept.pop(x) for x in links[live:]]
        for page in table:  # before a window slot is taken (that may evict retained pages)
            self.pool.acquire(page)
        # the slot whose entries [0, S0) hold the sink: the holder's, or the one kept with the first page (then the
        # request's own, unless it has one)
        sink = self.requests[holder].slot if holder is not None else index.sinks.pop(links[0])
        r = self.reserve(request_id, slot=None if holder is not None else sink)
        if r.slot != sink:
            for win in (self.windows.k, self.windows.v):  # [slots, L, Hk, S0 + R, D]: the sink, every layer
                win[r.slot, :, :, :s0] = win[sink, :, :, :s0]
            if holder is None:
                self.windows.release(sink, held=False)
        m = s0 + len(links) * p
        r.table, r.lengths, r.floor = table, dict.fromkeys(self.layer_slot, m), m
        index.adopt(request_id, links)
        return m, holder, len(links)

    def _window_source(self, tokens: list[int]) -> tuple[str, int, int] | None:
        """The live request that holds the most of ``tokens``' prefix in its final pages and its window: ``(holder, b,
        f)``, tokens ``[0, b)`` its, slots ``[S0, f)`` in its final pages and ``[f, b)`` in its window (which holds
        its last ``W + 1``); only a holder at most a page past the joiner's prompt (each slot it is ahead is one the
        joiner's first decode steps read in INT2, not from its window), and one whose page ``f`` ends inside (copied)
        only while a page is free."""
        s0, w, p, best = self.config.sink, self.config.recent, self.pool.page_size, None
        for hid, theirs in self.prefixes.tokens.items():  # (the requests that offered pages: all live)
            h = self.requests[hid]
            t = h.length()
            lo, hi = 0, min(len(tokens) - 1, t, len(theirs))  # b: the common prefix's length, by bisection
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if tokens[:mid] == theirs[:mid] else (lo, mid - 1)
            f = min(lo, max(t - w - 1, h.floor, s0))
            fits = (f - s0) % p == 0 or self.pool.num_free > 0
            if lo > s0 and fits and f - (len(tokens) - w - 1) <= p and (best is None or (lo, -f) > (best[1], -best[2])):
                best = (hid, lo, f)
        return best

    def _join_window(self, request_id: str, holder: str, b: int, f: int) -> tuple[int, str, int]:
        """:meth:`share_prefix` from a :meth:`_window_source`: ``holder``'s final pages below slot ``f`` (the last one
        a copy where ``f`` ends inside it), its window's rows for slots ``[f, b)`` and its sink; the request's floor
        is ``f``, so its own rows and decode steps read the slots below it from those pages."""
        s0, p, h = self.config.sink, self.pool.page_size, self.requests[holder]
        k, part = divmod(f - s0, p)
        # its pages before a window slot is taken (that may evict retained pages)
        table = self._take_pages(h.table, k, int(part > 0))
        r = self.reserve(request_id)
        entries = list(range(s0)) + [s0 + s % self.ring for s in range(f, b)]  # the sink, then the window's rows
        for win in (self.windows.k, self.windows.v):  # [slots, L, Hk, S0 + R, D]
            win[r.slot, :, :, entries] = win[h.slot, :, :, entries]
        r.table, r.lengths, r.floor = table, dict.fromkeys(self.layer_slot, b), f
        self.prefixes.adopt(request_id, self.prefixes.links.get(holder, [])[:k])
        return b, holder, len(table)

    def _take_pages(self, table: list[int], shared: int, copied: int) -> list[int]:
        """A new block table: ``table``'s first ``shared`` pages held once more, then copies of the ``copied`` after."""
        for page in table[:shared]:
            self.pool.acquire(page)
        new = table[:shared]
        for page in table[shared : shared + copied]:
            new.append(self.pool.allocate())
            self.pool.copy_page(page, new[-1])
        return new

    def pages_from(self, request_id: str, holder: str | None) -> int:
        """Pages a request that :meth:`share_prefix` started took from ``holder`` (its first; the others were kept)."""
        return 0 if holder is None else sum(map(operator.eq, self.requests[request_id].table,
                                                self.requests[holder].table))

    def _leave(self, r, links: list[int | None]) -> None:
        """Request ``r`` (a :class:`RequestKV`) left: its pages and window slot go back, but a page ``links`` names
        (indexed, no live request holds it: ``PrefixIndex.forget``) is retained, the deepest first (evicted first), and
        the slot with the first page (its sink)."""
        kept, sink = self.prefixes.kept if self.prefixes is not None else {}, False
        for b in reversed(range(len(r.table))):
            link = links[b] if b < len(links) else None
            if link in kept:  # another page keeps these tokens: it counts as released now
                self.pool.retained[kept[link]] = self.pool.retained.pop(kept[link])
                link = None
            if self.pool.release(r.table[b], link):
                kept[link], sink = r.table[b], b == 0
        self.windows.release(r.slot, keep=sink)
        if sink:
            self.prefixes.sinks[links[0]] = r.slot

    def _evicted(self, link: int) -> None:
        """The pool evicted the retained page of ``link``: the index forgets it; a first page's slot goes back."""
        del self.prefixes.kept[link]
        if (slot := self.prefixes.sinks.pop(link, None)) is not None:
            self.windows.release(slot, held=False)

    def drop_retained(self) -> None:
        """Evict every retained page (a stopping manager, a new pool), their index entries and kept slots with them."""
        while self.pool is not None and self.pool.retained:
            self.pool.evict()

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
        r.table = self._take_pages(s.table, k, len(s.table) - k)
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
