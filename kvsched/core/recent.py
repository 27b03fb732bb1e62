"""A bounded memory of recent keys: the newest `capacity` kept, the oldest forgotten first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class Recent(Generic[V]):
    """Keys with values, in insertion order, at most `capacity` of them."""

    __slots__ = ("_items", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._items: OrderedDict[str, V] = OrderedDict()

    def get(self, key: str) -> V | None:
        return self._items.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def add(self, key: str, value: V) -> None:
        """Remember `value` under `key`; the oldest key goes when over capacity."""
        self._items[key] = value
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def pop(self, key: str) -> V | None:
        return self._items.pop(key, None)

    def forget(self, stale: Callable[[V], bool]) -> None:
        """Drop every entry whose value is `stale`."""
        for key in [k for k, v in self._items.items() if stale(v)]:
            del self._items[key]
