"""What placing a request asks and answers: the query the Placer is given (`PlacementQuery`),
the decision it returns (`Placement`, with the KV transfers it ordered), and an instance the
Router's own placement may pick (`KnownInstance`). Values only; the deciding is the Placer's
(`placer`, `local_placement`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.core.adapters import NO_CHANGE, AdapterChange


@dataclass(frozen=True, slots=True)
class KnownInstance:
    """An instance the fallback may pick."""

    instance_id: str
    url: str
    model: str = ""  # the model it serves ("": not said)


@dataclass(frozen=True, slots=True)
class PlacementQuery:
    """What the Conductor needs to place one request."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    packed_hashes: bytes  # the prompt's block hashes, packed (`clients.python.pack_hashes`)
    session_id: str  # tenant-scoped ("tenant/session"); empty for none
    model: str = ""  # the served model asked for ("": any instance)
    adapter: str = ""  # its LoRA adapter ("": the base model)
    adapter_bytes: int = 0


@dataclass(frozen=True, slots=True)
class PlannedTransfer:
    """A KV transfer the Conductor ordered with a decision."""

    transfer_id: str
    kind: int  # kvsched.common.v1.TransferKind
    source_instance_id: str
    on_critical_path: bool


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes, and who decided."""

    request_id: str
    instance_id: str
    url: str  # the engine's base URL
    policy: str  # the Conductor's policy; empty when the fallback decided
    rule: str
    expected_cached_tokens: int
    fallback: str | None = None  # why the local fallback decided; None: the Conductor did
    decode_instance_id: str = ""  # another instance decodes (disaggregated); "" for none
    decode_url: str = ""
    transfers: tuple[PlannedTransfer, ...] = ()
    # Transfers under way for earlier requests that bring KV this one counts on.
    landing: tuple[PlannedTransfer, ...] = ()
    # What the instance, and the decode instance, load and unload first (LoRA adapters).
    adapter_change: AdapterChange = NO_CHANGE
    decode_adapter_change: AdapterChange = NO_CHANGE

    @property
    def by_conductor(self) -> bool:
        return self.fallback is None
