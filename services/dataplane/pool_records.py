"""What the node KV pool answers and counts: an export (`Exported`) and an import's staged
pages (`ImportSlots`), what it holds (`PoolUsage`), and its totals of the engines' copies
(`CopyTotals`) and of its checks of its blocks' bytes (`CheckTotals`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.core.vllm_hashing import AdapterKey


@dataclass(frozen=True, slots=True)
class Exported:
    """An export: blocks pinned for reading, from the asked start on."""

    export_id: str
    blocks: int
    pages: tuple[int, ...]
    token_ids: tuple[int, ...]
    cache_salt: str | None
    adapter: AdapterKey | None = None  # the LoRA adapter the blocks were computed with


@dataclass(frozen=True, slots=True)
class ImportSlots:
    """An import: pages staged for the blocks after the `have` the pool holds already (no
    import, and no pages, when it holds them all)."""

    import_id: str | None
    have: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """What the pool holds now."""

    pages: int  # its size, in blocks
    blocks: int  # held (readable, evictable unless pinned)
    pinned: int  # held blocks an export or a load pins
    staged: int  # pages reserved for saves and transfers not committed yet
    exports: int
    imports: int


@dataclass(slots=True)
class CopyTotals:
    """Copies between the node's engines and the pool, as the engines report them: `load`
    (pool to engine) and `save` (engine to pool)."""

    bytes: dict[str, int]
    seconds: dict[str, float]

    @classmethod
    def empty(cls) -> CopyTotals:
        return cls({"load": 0, "save": 0}, {"load": 0.0, "save": 0.0})

    def record(self, direction: str, nbytes: int, seconds: float) -> None:
        self.bytes[direction] += nbytes
        self.seconds[direction] += seconds


@dataclass(slots=True)
class CheckTotals:
    """The pool's checks of its blocks' bytes: `checked` bytes and `seconds` when a save or
    import commits (`commit`: the checksums computed) and when a load or export is granted
    (`export`: checked against them); `corrupt` blocks found with other bytes than saved
    (counted each time a check finds one), `dropped` blocks removed for it (the corrupt ones
    and those below them)."""

    checked: dict[str, int]
    seconds: dict[str, float]
    corrupt: int = 0
    dropped: int = 0

    @classmethod
    def empty(cls) -> CheckTotals:
        return cls({"commit": 0, "export": 0}, {"commit": 0.0, "export": 0.0})

    def record(self, when: str, nbytes: int, seconds: float) -> None:
        self.checked[when] += nbytes
        self.seconds[when] += seconds
