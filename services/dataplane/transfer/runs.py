"""Runs: the unit a transfer moves. A run is a stretch of pages consecutive on both the
source and the destination, so within one layer it is one contiguous piece of memory on each
side (see `services.dataplane.kv_layout`): one entry for Mooncake, one slice for TCP."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from services.dataplane.kv_layout import KvLayout

T = TypeVar("T")
Span = tuple[int, int]  # [start, stop) byte offsets within a layer


@dataclass(frozen=True, slots=True)
class Run:
    """Pages `src_page..src_page+count-1` of the source go to `dst_page..dst_page+count-1`
    of the destination (in every layer a read moves)."""

    src_page: int
    dst_page: int
    count: int

    def __post_init__(self) -> None:
        if self.src_page < 0 or self.dst_page < 0 or self.count <= 0:
            raise ValueError(f"a run needs pages >= 0 and a positive count, got {self}")


def coalesce(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[Run]:
    """The pairs (src_pages[i], dst_pages[i]), in order, as the fewest runs: a new run starts
    whenever either side is not the previous page plus one."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(
            f"{len(src_pages)} source pages but {len(dst_pages)} destination pages: "
            "every block needs a page on both sides"
        )
    runs: list[Run] = []
    i, n = 0, len(src_pages)
    while i < n:
        j = i + 1
        while (
            j < n and src_pages[j] == src_pages[j - 1] + 1 and dst_pages[j] == dst_pages[j - 1] + 1
        ):
            j += 1
        runs.append(Run(src_pages[i], dst_pages[i], j - i))
        i = j
    return runs


def run_pages(runs: Sequence[Run]) -> int:
    """Pages the runs move per layer."""
    return runs.pages if isinstance(runs, Runs) else sum(r.count for r in runs)


def merge_spans(pages: Iterable[tuple[int, int]], chunk_bytes: int) -> list[Span]:
    """The byte spans within a layer of (page, count) stretches read in order, a stretch that
    starts where the previous one ends merged into it: as few pieces as the memory allows."""
    spans: list[list[int]] = []
    for page, count in pages:
        start = page * chunk_bytes
        if spans and spans[-1][1] == start:
            spans[-1][1] = start + count * chunk_bytes
        else:
            spans.append([start, start + count * chunk_bytes])
    return [(a, b) for a, b in spans]


class Runs(tuple[Run, ...]):
    """Runs prepared once for all the layers of a transfer: an immutable sequence of `Run`
    that also knows its pages, its extent on each side and, per chunk size, the merged byte
    spans of a layer on each side. Readers accept any sequence of runs; handing them a `Runs`
    does that per-run work once instead of at every read (it matters for small chunks)."""

    pages: int  # moved per layer
    src_end: int  # one past the highest source page
    dst_end: int
    _memo: dict[object, object]

    def __new__(cls, runs: Iterable[Run]) -> Runs:
        self = super().__new__(cls, runs)
        self.pages = sum(r.count for r in self)
        self.src_end = max((r.src_page + r.count for r in self), default=0)
        self.dst_end = max((r.dst_page + r.count for r in self), default=0)
        self._memo = {}
        return self

    def spans(self, side: Literal["src", "dst"], chunk_bytes: int) -> list[Span]:
        """`merge_spans` of the source's (or the destination's) side (computed once)."""
        return self.memo(
            (side, chunk_bytes),
            lambda: merge_spans(
                ((r.src_page if side == "src" else r.dst_page, r.count) for r in self),
                chunk_bytes,
            ),
        )

    def memo(self, key: object, make: Callable[[], T]) -> T:
        """`make()`, computed once per `key` for these runs (e.g. a backend's encoding)."""
        try:
            return self._memo[key]  # type: ignore[return-value]
        except KeyError:
            value = self._memo[key] = make()
            return value

    def __repr__(self) -> str:
        return f"Runs({list(self)!r})"


def prepare(runs: Sequence[Run]) -> Runs:
    """`runs` as `Runs` (itself when it already is)."""
    return runs if isinstance(runs, Runs) else Runs(runs)


class LastRuns:
    """`prepare` remembering the last runs it prepared: a runner hands a reader the same list
    for every layer, and recognising it (as long, holding the very same `Run` objects, so a
    list changed in place is prepared again) costs far less than preparing it again."""

    def __init__(self) -> None:
        self._last: Runs | None = None

    def __call__(self, runs: Sequence[Run]) -> Runs:
        if isinstance(runs, Runs):
            return runs
        last = self._last
        if last is not None and len(last) == len(runs) and all(map(operator.is_, last, runs)):
            return last
        self._last = prepared = Runs(runs)
        return prepared


def check_read(layer: int, runs: Runs, src: KvLayout, dst: KvLayout) -> None:
    """Raise `ValueError` unless `runs` of `layer` fit both layouts: the same chunk size, the
    layer and every page in range on each side, at least one run, and at most one layer's
    worth of pages (what a source serves per request)."""
    if src.chunk_bytes != dst.chunk_bytes:
        raise ValueError(
            f"source chunks are {src.chunk_bytes} bytes, destination chunks {dst.chunk_bytes}: "
            "KV moves only between engines of the same model and block size"
        )
    if not (0 <= layer < src.layers and layer < dst.layers):
        raise ValueError(f"layer {layer} is outside {src.layers} (source) / {dst.layers} layers")
    if not runs:
        raise ValueError("a read needs at least one run")
    if runs.src_end > src.pages or runs.dst_end > dst.pages:
        raise ValueError(
            f"runs reach page {runs.src_end - 1} of the source ({src.pages} pages) and "
            f"{runs.dst_end - 1} of the destination ({dst.pages} pages)"
        )
    if runs.pages > src.pages:
        raise ValueError(
            f"a read moves at most one layer of the source ({src.pages} pages), got {runs.pages}"
        )
