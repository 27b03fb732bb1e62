"""How a `PlacementStream` follows the leader: which Conductor each of its calls goes to, and
how long it waits before opening the next.

A call that broke or that the server ended (the leader died, stepped down or got stuck) is
opened again to the leader found anew. A standby's refusal that names the leader
(FAILED_PRECONDITION with the `kvsched-leader` trailer) is followed at once, unless the call
before was redirected too; every other reopen waits the client's backoff. When `retries`
reopens in a row bring no healthy call (one that answered something or stayed up a while),
or when the stream itself is refused (e.g. UNIMPLEMENTED), every unanswered item fails and
the stream waits for new work.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

import grpc

from clients.python.channels import normalize_address
from clients.python.errors import LEADER_TRAILER, ConductorError, Unavailable, error_for
from clients.python.leader import LeaderFinder
from clients.python.placement_calls import StreamEnd

# How a placement stream may end and still be worth reopening (every item is idempotent).
_STREAM_RETRYABLE: Final = frozenset(
    {
        grpc.StatusCode.OK,  # the server ended the stream without being asked to
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        # grpc reports a connection lost while a message was being sent as INTERNAL
        # ("Failed execute_batch"): seen when the leader is killed mid-stream.
        grpc.StatusCode.INTERNAL,
    }
)


class ReconnectClient(Protocol):
    """What following the leader uses of the client (`ConductorClient`): its leader finder,
    its retries and its backoff."""

    retries: int
    _leaders: LeaderFinder

    def _backoff(self, attempt: int) -> float: ...


async def follow_leader(
    client: ReconnectClient,
    stop: asyncio.Event,
    *,
    serve: Callable[[str], Awaitable[StreamEnd | None]],
    fail_all: Callable[[ConductorError], None],
    idle: Callable[[], Awaitable[bool]],
) -> None:
    """Open the stream's calls (`serve(target)`, None when the stream closed) one after
    another until `stop` is set. `fail_all` fails every unanswered item; `idle` waits for
    new work after that (False: the stream closed meanwhile)."""
    failures = 0
    redirect: str | None = None
    was_redirect = False
    last = "no attempt yet"
    while not stop.is_set():
        if failures > client.retries:
            fail_all(
                Unavailable(
                    grpc.StatusCode.UNAVAILABLE,
                    f"placement stream: no leader within {client.retries} retries; last: {last}",
                )
            )
            failures = 0
            if not await idle():
                break
        try:
            target = redirect or await client._leaders.ensure()
        except Unavailable as err:
            last, was_redirect = err.message, False
            failures += 1
            if failures <= client.retries:
                await _pause(stop, client._backoff(failures - 1))
            continue
        except ConductorError:  # the client was closed
            break
        redirect = None
        end = await serve(target)
        if end is None:  # closed
            break
        if end.healthy:
            failures = 0
        last = f"{target}: {end.code.name} {end.details}"
        now_redirect = False
        leader = end.trailers.get(LEADER_TRAILER)
        if end.code == grpc.StatusCode.FAILED_PRECONDITION and leader is not None:
            leader = normalize_address(leader)
            if leader and leader != target:
                client._leaders.follow(leader)
                redirect = leader
                now_redirect = True
            else:
                client._leaders.forget(target)
        elif end.code in _STREAM_RETRYABLE:
            client._leaders.forget(target)
        else:  # the stream itself is refused (e.g. UNIMPLEMENTED): fail the items
            fail_all(error_for(end.code, end.details, end.trailers))
            failures = 0
            if not await idle():
                break
            continue
        delay = 0.0 if now_redirect and not was_redirect else client._backoff(failures)
        was_redirect = now_redirect
        failures += 1
        if failures <= client.retries and delay:
            await _pause(stop, delay)


async def _pause(stop: asyncio.Event, delay: float) -> None:
    """Sleep, but wake when `stop` is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay):
            await stop.wait()
