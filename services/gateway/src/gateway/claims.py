"""Claims: what the gateway has open on each backend, and the lines of requests waiting
for KV-cache room there, one line per backend.

`Claims` is the interface the backends, admission, the upstream and discovery count
with; two implementations: `InflightCounter`, one process's (single event loop: no lock), and
`shared_claims.SharedInflight`, every worker's of `lorastack gateway --workers N`. A
request joins the lines of the backends that could take it (`join`) when none has room,
waits for its turn (`next_turn`: room given back there, or the request before it left),
and leaves once admitted, refused or cancelled (`leave`); `blocked` names the backends
where a request that came earlier waits, which routing must not take.

Owns: that interface and one process's counts and lines. Does not own: scoring
(`routing.py`, pure), when a request waits or is sent (`admission.py`), the file the
workers share (`shared_claims.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class Turn(asyncio.Event):
    """A request's place in the line for KV-cache room: its ticket (order of arrival, one
    counter across workers) and the backends it waits for (those serving its model that
    could ever take its claim); set when it should look for room again."""

    def __init__(self, ticket: int, backends: frozenset[str]) -> None:
        super().__init__()
        self.ticket = ticket
        self.backends = backends


NO_TICKET = 2**62  # no request waits: later than any ticket

# a backend's place in `backends_dns`, as the counts keep it for every worker at once
GONE, MEMBER, DRAINING = 0, 1, 2


class Membership(NamedTuple):
    """What DNS discovery did, each event counted once however many workers saw it."""

    discovered: int  # backends that appeared (again)
    removed: int  # backends forgotten once drained
    drained_requests: int  # requests open on a backend when it began draining
    draining: int  # backends draining now


class Claims(Protocol):
    """The gateway's open requests and KV claims per backend, the discovery membership it
    counts once, and the lines for KV-cache room (`InflightCounter` or `SharedInflight`)."""

    @property
    def counts(self) -> Mapping[str, int]:
        """Open requests per backend URL."""
        ...

    @property
    def sent(self) -> Mapping[str, int]:
        """Requests ever sent per backend URL (a scrape tells which came after it)."""
        ...

    @property
    def tokens(self) -> Mapping[str, int]:
        """KV claims of the open requests per backend URL, tokens."""
        ...

    @property
    def waiting(self) -> int:
        """Requests in line now."""
        ...

    def add(self, url: str, delta: int, tokens: int = 0) -> None:
        """`delta` requests (+1 sent, -1 ended) holding `tokens` (signed like `delta`)."""

    def claimed(self, url: str) -> tuple[int, int]:
        """(open requests, their KV claims in tokens) on `url` now: exact under `exclusive`."""
        ...

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Hold the counts still: a pick and its claim happen in one hold."""
        ...

    def forget(self, url: str) -> None:
        """Drop a backend the gateway forgot (drained): removed, if it was draining."""

    def found(self, url: str) -> None:
        """`url` appeared in `backends_dns`: discovered, unless it is a member already."""

    def draining(self, url: str, open_requests: int) -> None:
        """`url` left `backends_dns` with `open_requests` open on it."""

    def resumed(self, url: str) -> None:
        """`url` came back to `backends_dns` while draining."""

    def membership(self) -> Membership:
        """The discovery counters and the backends draining now."""
        ...

    def blocked(self, turn: Turn | None) -> frozenset[str]:
        """Backends where a request that came before `turn` (None: any request) waits."""
        ...

    def join(self, backends: Collection[str]) -> Turn:
        """A place at the end of the line of each of `backends`; `leave` it once admitted,
        refused or cancelled."""
        ...

    def heads(self, turn: Turn) -> bool:
        """Whether `turn` is first in the line of one of its backends (this process's)."""
        ...

    async def next_turn(self, turn: Turn, timeout_s: float, relook_s: float) -> None:
        """Return once woken, after `relook_s` when `turn` heads a line, or after
        `timeout_s`."""

    def leave(self, turn: Turn) -> None:
        """Out of the line; the next on each of its backends looks for room."""


@dataclass
class InflightCounter:
    """The gateway's own open requests per backend (single event loop: no lock needed),
    how many it ever sent to each (so a scrape can tell which came after it), and the
    lines of requests waiting for KV-cache room: one per backend.

    Each line is first come, first served: a request looks for room only on the backends
    where no request that came before it waits, so a large request is not starved by a
    stream of small ones on its backend, and a request for a model whose backends have
    room never waits behind a request that waits for another backend (issue 58). Room
    given back on a backend wakes the first request in its line; a request leaving the
    line wakes the next on each of its backends."""

    counts: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # KV claims of open requests
    # backend -> the requests waiting for room on it, first come first
    _lines: dict[str, list[Turn]] = field(default_factory=dict)
    _waiting: int = 0
    _tickets: Iterator[int] = field(default_factory=itertools.count)
    _members: dict[str, int] = field(default_factory=dict)  # url -> MEMBER or DRAINING
    _events: list[int] = field(default_factory=lambda: [0, 0, 0])  # Membership's counters

    def add(self, url: str, delta: int, tokens: int = 0) -> None:
        """`delta` requests (+1 sent, -1 ended) holding `tokens` (signed like `delta`)."""
        self.counts[url] = self.counts.get(url, 0) + delta
        if delta > 0:
            self.sent[url] = self.sent.get(url, 0) + delta
        if tokens:
            self.tokens[url] = self.tokens.get(url, 0) + tokens
        if delta < 0 and (line := self._lines.get(url)):
            line[0].set()  # room given back: the first in its line looks again

    def claimed(self, url: str) -> tuple[int, int]:
        """(open requests, their KV claims in tokens) on `url` now."""
        return self.counts.get(url, 0), self.tokens.get(url, 0)

    def forget(self, url: str) -> None:
        """Drop a backend the gateway forgot (nothing is open on it): removed, if it was
        draining."""
        if self._members.pop(url, GONE) == DRAINING:
            self._events[1] += 1
        for table in (self.counts, self.sent, self.tokens):
            table.pop(url, None)

    def found(self, url: str) -> None:
        """`url` appeared in `backends_dns`: discovered, unless it is a member already."""
        if self._members.get(url, GONE) == GONE:
            self._members[url] = MEMBER
            self._events[0] += 1

    def draining(self, url: str, open_requests: int) -> None:
        """`url` left `backends_dns` with `open_requests` open on it."""
        if self._members.get(url, GONE) == MEMBER:
            self._members[url] = DRAINING
            self._events[2] += open_requests

    def resumed(self, url: str) -> None:
        """`url` came back to `backends_dns` while draining."""
        if self._members.get(url, GONE) == DRAINING:
            self._members[url] = MEMBER

    def membership(self) -> Membership:
        """The discovery counters and the backends draining now."""
        draining = sum(state == DRAINING for state in self._members.values())
        discovered, removed, drained_requests = self._events
        return Membership(discovered, removed, drained_requests, draining)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """What `shared_claims.SharedInflight` locks across workers: one loop needs nothing."""
        yield

    @property
    def waiting(self) -> int:
        """Requests in line now."""
        return self._waiting

    def blocked(self, turn: Turn | None) -> frozenset[str]:
        """Backends where a request that came before `turn` (None: any request) waits."""
        if not self._waiting:
            return frozenset()
        ticket = NO_TICKET if turn is None else turn.ticket
        return frozenset(url for url, line in self._lines.items() if line[0].ticket < ticket)

    def join(self, backends: Collection[str]) -> Turn:
        """A place at the end of the line of each of `backends`; `leave` it once admitted,
        refused or cancelled."""
        turn = Turn(next(self._tickets), frozenset(backends))
        for url in turn.backends:
            self._lines.setdefault(url, []).append(turn)
        self._waiting += 1
        return turn

    def heads(self, turn: Turn) -> bool:
        """Whether `turn` is first in the line of one of its backends."""
        return any(self._lines[url][0] is turn for url in turn.backends)

    async def next_turn(self, turn: Turn, timeout_s: float, relook_s: float) -> None:
        """Return once woken (room given back on one of `turn`'s backends, or the request
        before it left), after `relook_s` when `turn` heads a line (a scrape may have found
        room or a backend come up), or after `timeout_s`."""
        wait_s = min(timeout_s, relook_s) if self.heads(turn) else timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(turn.wait(), wait_s)
        turn.clear()

    def leave(self, turn: Turn) -> None:
        """Out of the line; the next on each of its backends looks for room."""
        for url in turn.backends:
            line = self._lines[url]
            was_head = line[0] is turn
            line.remove(turn)
            if not line:
                del self._lines[url]
            elif was_head:
                line[0].set()
        self._waiting -= 1
