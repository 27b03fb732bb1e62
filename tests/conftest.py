"""Shared factories: tiny clusters, views and traces built by hand."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import settings

from kvsched.core.cluster import ClusterConfig, ClusterState, Role, SloConfig, build_cluster
from kvsched.core.decision import RequestInfo
from kvsched.core.load import LoadReport
from kvsched.sim.traces.model import Trace, TraceCall

pytest_plugins = ["tests.fixtures.etcd", "tests.fixtures.otlp"]

# Property tests draw the same examples on every run, so a green main stays green; explore
# new ones with `pytest --hypothesis-profile=explore` (and keep what they find as tests).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", max_examples=2000)
settings.load_profile("repeatable")


def _mooncake_loads() -> bool:
    try:
        importlib.import_module("mooncake.engine")
    except (ImportError, OSError):
        return False
    return True


# Tests of the mooncake transfer backend: its wheel needs Debian's libibverbs1, which only
# root can install (.ci/run does); without it they are skipped, saying so.
MOONCAKE = pytest.mark.skipif(
    not _mooncake_loads(),
    reason="mooncake-transfer-engine does not load here (it needs Debian's libibverbs1)",
)

REPO = Path(__file__).resolve().parent.parent
SLICES = REPO / "data" / "traces"
SHARED = REPO.parent / "shared"


def make_cluster(
    n: int = 4,
    *,
    block_size: int = 16,
    roles: Sequence[Role] = (),
    capacity_tokens: int = 0,
    slo: SloConfig | None = None,
) -> ClusterState:
    return build_cluster(
        ClusterConfig(
            n_instances=n,
            block_size=block_size,
            roles=tuple(roles),
            kv_capacity_tokens=capacity_tokens,
            slo=slo or SloConfig(),
        )
    )


def chain(prefix: int, n: int) -> tuple[int, ...]:
    """`n` distinct fake block hashes sharing nothing with other prefixes."""
    return tuple(prefix * 1_000_000 + i + 1 for i in range(n))


def request(
    rid: int,
    hashes: tuple[int, ...],
    *,
    prompt: int | None = None,
    output: int = 16,
    session: str | None = None,
    block_size: int = 16,
) -> RequestInfo:
    tokens = prompt if prompt is not None else len(hashes) * block_size + 1
    return RequestInfo(rid, tokens, output, hashes, session)


def set_load(
    cluster: ClusterState, slot: int, *, pending: int = 0, running: int = 0, free: int | None = None
) -> None:
    """Pretend instance `slot` reported this load (seconds estimated from the latency model)."""
    pending_s = cluster.cost.prefill_one(pending, 0) if pending else 0.0
    cluster.load.report(
        slot,
        LoadReport(
            pending_prefill_tokens=pending,
            pending_prefill_s=pending_s,
            waiting=1 if pending else 0,
            running=running,
            decode_tokens=0,
            free_blocks=cluster.capacity_blocks if free is None else free,
        ),
    )


def tiny_trace(
    calls: Sequence[tuple[str, float, int, int, tuple[int, ...]]], block_tokens: int = 16
) -> Trace:
    """Open-loop trace from (session, timestamp, input, output, block ids) tuples."""
    return Trace(
        "tiny",
        "mooncake",
        block_tokens,
        tuple(
            TraceCall(i, s, s or f"g{i}", t, p, o, ids) for i, (s, t, p, o, ids) in enumerate(calls)
        ),
        closed_loop=False,
    )


@pytest.fixture
def cluster4() -> ClusterState:
    return make_cluster(4)
