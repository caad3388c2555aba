"""Work a generator waits on: items handed on and not yet answered (modules without a
kernel, kernels without a verdict)."""

from __future__ import annotations

import time
from collections.abc import Iterator


class Backlog:
    """Ids of items handed on and not yet answered, each with when it was counted.

    An item counted more than ``forget_s`` before the newest item answered since stops
    counting (``forget_passed_over(forget_s)``): whoever answers passed it over (dead-lettered it,
    say), and an answer may never come; counted for ever, enough of them would stop the
    generator for good. One that answers nothing (slow, or stopped) holds the count
    however long it takes. An item answered once is not counted again: its answer may be
    read before it (from another stream that got there first), and it may be counted
    twice (once when handed on, once when read back from the store).
    """

    def __init__(self) -> None:
        self._items: dict[str, float] = {}
        self._answered: set[str] = set()  # a run's ids: a few MB for 100,000 of them
        self._newest_answered_at = float("-inf")  # when the newest answered item was counted

    def add(self, item_id: str, at: float | None = None) -> None:
        """Counts ``item_id`` as waiting for its answer (unless it has had one)."""
        if item_id not in self._answered:
            self._items.setdefault(item_id, time.monotonic() if at is None else at)

    def answer(self, item_id: str) -> None:
        """Takes ``item_id`` off the backlog, for good."""
        self._answered.add(item_id)
        at = self._items.pop(item_id, None)
        if at is not None:
            self._newest_answered_at = max(self._newest_answered_at, at)

    def forget_passed_over(self, forget_s: float) -> int:
        """Stops counting the items passed over (see the class); returns how many."""
        oldest = self._newest_answered_at - forget_s
        stale = [i for i, at in self._items.items() if at < oldest]
        for i in stale:
            del self._items[i]
        return len(stale)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items
