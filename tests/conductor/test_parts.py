"""The Conductor's pieces without etcd: the servicer's binding of RPCs to parts, terms,
event cursors, conversion that changes nothing, and logs that name no session id."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any

import pytest

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.cluster import Role, build_cluster
from kvsched.core.events import BlocksStored
from kvsched.core.index import Tier
from kvsched.core.load import LoadReport
from kvsched.core.requests import RequestError
from services.common.serving.log_ids import session_tag
from services.common.store.interface import WatchEvent
from services.common.store.memory import MemoryStore
from services.conductor import keys, placement_messages, replica, settings
from services.conductor.cursors import MAX_LAG_S, MAX_LAGGING_BATCHES
from services.conductor.election import Election, LeaderInfo
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.service import RPCS, conductor_servicer
from services.conductor.settings import ConductorSettings
from services.conductor.term import Term, TermHolder
from tests.fixtures.poll import wait_for


def _part(*names: str) -> Any:
    async def handler(request: object, context: object) -> None:
        return None

    part = type("Part", (), {})()
    for name in names:
        setattr(part, name, handler)
    return part


def _term() -> Term:
    term = Term.build(ConductorSettings(max_instances=2), "test")
    record = InstanceRecord(InstanceSpec("a", "http://a", "node-0", Role.BOTH), 0, 7)
    term.state.add_instance(record)
    return term


def test_every_rpc_is_bound_to_exactly_one_part() -> None:
    half = len(RPCS) // 2
    servicer = conductor_servicer(_part(*RPCS[:half]), _part(*RPCS[half:]))
    assert all(callable(getattr(servicer, name)) for name in RPCS)
    with pytest.raises(TypeError, match=f"RPC {RPCS[-1]} needs exactly one handler; found none"):
        conductor_servicer(_part(*RPCS[:-1]))
    with pytest.raises(TypeError, match="found Part, Part"):
        conductor_servicer(_part(*RPCS), _part(RPCS[0]))


def test_a_swapped_term_is_what_every_reader_sees() -> None:
    first, second = _term(), Term.build(ConductorSettings(max_instances=2), "next")
    holder = TermHolder(first)
    current = holder.current
    assert current() is first
    holder.swap(second)
    assert current() is second and current().state.instances == {}


def test_cursors_apply_in_sequence_and_queue_the_cursor() -> None:
    term = _term()
    stored = [BlocksStored((11, 12), None, Tier.GPU)]
    with pytest.raises(RequestError) as refused:
        term.cursors.apply("a", 3, False, stored)
    assert refused.value.next_sequence == 0
    assert term.state.cluster.index.block_count(0) == 0  # refused whole
    assert term.cursors.apply("a", 0, False, stored) == 1
    assert term.state.cluster.index.block_count(0) == 2
    assert term.outbox.writes[keys.cursor_key("a")] == (b"1", 7)
    assert keys.block_key("a", Tier.GPU, 12) in term.outbox.writes  # the records observed it


def _cursor_queued(term: Term) -> bytes | None:
    """The cursor value queued for instance "a" since the last look (emptying the outbox)."""
    return {k: v for k, v, _ in term.outbox.take()}.get(keys.cursor_key("a"))


def test_load_only_batches_let_the_etcd_cursor_lag_within_bounds() -> None:
    term, now = _term(), [100.0]
    term.cursors.clock = lambda: now[0]
    load = [LoadReport(0, 0.0, 0, 1, 0, 500)]
    stored = [BlocksStored((11, 12), None, Tier.GPU)]
    assert term.cursors.apply("a", 0, False, stored) == 1
    assert _cursor_queued(term) == b"1"
    # Load reports change nothing etcd holds: their cursors are not queued on their own...
    seq = 1
    for _ in range(MAX_LAGGING_BATCHES):
        seq = term.cursors.apply("a", seq, False, load)
        now[0] += 0.001
    assert seq == 1 + MAX_LAGGING_BATCHES  # (the in-memory cursor, the resume point, moved)
    assert _cursor_queued(term) is None and len(term.outbox) == 0
    assert term.state.cluster.load.running[0] == 1  # (applied all the same)
    # ...up to the bound in batches, then the latest cursor goes,
    seq = term.cursors.apply("a", seq, False, load)
    assert _cursor_queued(term) == str(seq).encode()
    # and to the bound in time,
    seq = term.cursors.apply("a", seq, False, load)
    assert _cursor_queued(term) is None
    now[0] += MAX_LAG_S
    seq = term.cursors.apply("a", seq, False, load)
    assert _cursor_queued(term) == str(seq).encode()
    # and with any batch that writes blocks (after them), or restarts the sequence.
    seq = term.cursors.apply("a", seq, False, load)
    seq = term.cursors.apply("a", seq, False, [*load, BlocksStored((13,), 12, Tier.GPU)])
    writes = [k for k, _, _ in term.outbox.take()]
    assert writes == [keys.block_key("a", Tier.GPU, 13), keys.cursor_key("a")]
    seq = term.cursors.apply("a", seq, False, load)
    assert _cursor_queued(term) is None
    assert term.cursors.apply("a", 0, True, load, merge=True) == 1
    assert _cursor_queued(term) == b"1"


def test_a_completion_is_converted_without_changing_the_state() -> None:
    term = _term()
    request = pb.FinishRequest(request_id="r", instance_id="a", prompt_tokens=40, ok=True)
    done = placement_messages.completion(term.state, request, now=10.0)
    assert (done.instance, done.decode_instance, done.finished_at) == (0, 0, 10.0)
    assert len(term.state.cluster.sessions) == 0 and len(term.outbox) == 0
    with pytest.raises(RequestError, match="request_id is required"):
        placement_messages.completion(term.state, pb.FinishRequest(instance_id="a"), now=10.0)
    with pytest.raises(RequestError, match="unknown instance"):
        placement_messages.completion(
            term.state, pb.FinishRequest(request_id="r", instance_id="b"), 1.0
        )


def test_a_session_key_is_logged_by_the_ids_tag() -> None:
    user = "alice@example.com/chat-7"
    tag = session_tag(user)
    assert re.fullmatch("[0-9a-f]{12}", tag) and tag == session_tag(user)
    assert tag != session_tag(user + "x")
    assert keys.loggable(keys.session_key(user)) == keys.SESSIONS + tag
    assert keys.loggable(keys.instance_key("a")) == keys.instance_key("a")


async def test_an_unreadable_session_record_is_logged_without_its_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    user = "alice@example.com/chat-7"
    store = MemoryStore()
    election = Election(store, LeaderInfo("c1", "http://c1", "http://c1-admin"), ttl_s=5)
    follow = asyncio.create_task(replica.follow(store, _term().state, election, 0))
    try:
        await store.put(keys.session_key(user).encode(), b"not a session record")
        await wait_for(lambda: "skipping unreadable record" in caplog.text)
    finally:
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow
    assert session_tag(user) in caplog.text
    assert "alice" not in caplog.text


@pytest.mark.parametrize(
    ("flags", "ttl", "cap", "sweep"),
    [
        ([], 3600.0, 1_000_000, 30.0),  # a tenth of an hour is over the 30 s ceiling
        (["--session-ttl", "60"], 60.0, 1_000_000, 6.0),
        (["--session-ttl", "60", "--time-scale", "0.5"], 60.0, 1_000_000, 3.0),  # wall s
        (["--session-ttl", "0"], 0.0, 1_000_000, 30.0),  # the cap alone still sweeps
        (["--session-ttl", "0", "--max-sessions", "0"], 0.0, 0, 30.0),  # the tenants' cap
        (
            ["--session-ttl", "0", "--max-sessions", "0", "--max-sessions-per-tenant", "0"],
            0.0,
            0,
            0.0,
        ),  # never: no sweep
    ],
)
def test_session_lifetime_flags_and_the_sweep_period(
    flags: list[str], ttl: float, cap: int, sweep: float
) -> None:
    s = settings.parse([*flags, "--insecure"])
    assert (s.session_ttl_s, s.max_sessions, s.session_sweep_s) == (ttl, cap, sweep)


def test_a_negative_session_ttl_is_refused() -> None:
    with pytest.raises(SystemExit):
        settings.parse(["--session-ttl", "-1", "--insecure"])


def test_the_leaders_deleted_session_record_is_forgotten_by_a_follower() -> None:
    term = _term()
    state = term.state
    state.scheduler.cluster.sessions.arrive("s", 1.0)
    election = Election(MemoryStore(), LeaderInfo("c2", "", ""), 1)
    deleted = WatchEvent("delete", keys.session_key("s").encode(), b"", 7)
    replica.apply_change(state, election, deleted)
    assert state.cluster.sessions.get("s") is None


def test_without_mutual_tls_or_insecure_it_refuses_to_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exited:
        settings.parse([])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--tls-client-ca" in err and "--messenger-tls-cert" in err and "--insecure" in err
    mutual = ["--tls-cert", "c.pem", "--tls-key", "c.key", "--tls-client-ca", "ca.pem"]
    mutual += ["--messenger-tls-ca", "ca.pem", "--messenger-tls-cert", "c.pem"]
    mutual += ["--messenger-tls-key", "c.key"]
    with pytest.raises(SystemExit):
        settings.parse(mutual)  # no admin token
    assert "--admin-token-file" in capsys.readouterr().err
    (tmp_path / "token").write_text("s3cret\n")
    s = settings.parse([*mutual, "--admin-token-file", str(tmp_path / "token")])
    assert s.tls is not None and s.tls.client_ca_file == "ca.pem" and s.admin_token == "s3cret"
    assert "s3cret" not in repr(s)
    assert settings.parse(["--insecure"]).admin_token is None


def test_the_pool_link_flags_reach_the_cost_model() -> None:
    s = settings.parse(["--pool-bandwidth", "2.5e10", "--pool-setup", "0.001", "--insecure"])
    link = build_cluster(s.cluster_config()).cost.pool_link
    assert (link.bandwidth_bytes_per_s, link.setup_s) == (2.5e10, 0.001)
    default = settings.parse(["--insecure"]).cluster_config().pool_link
    assert default.bandwidth_bytes_per_s == 50e9
    for bad in (["--pool-bandwidth", "0"], ["--pool-setup", "-1"], ["--pool-bandwidth", "nan"]):
        with pytest.raises(SystemExit):
            settings.parse([*bad, "--insecure"])
