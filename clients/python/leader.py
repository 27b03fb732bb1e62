"""Finding the Conductor that leads: `LeaderFinder` keeps the address believed to lead and
asks the Conductors (GetLeader) when it does not know or that address failed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from grpc import aio

from clients.python.channels import Channels, normalize_address
from clients.python.errors import ConductorError, Unavailable, from_rpc_error
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb


class LeaderFinder:
    """The leader as far as the client knows (`current`), and how it finds out: each address
    is asked in turn until one leads or names a leader that confirms; the round is repeated
    after a backoff while an election runs, up to `retries` more rounds. `check_open` raises
    once the client is closed."""

    def __init__(
        self,
        addresses: tuple[str, ...],
        channels: Channels,
        *,
        deadline_s: float,
        retries: int,
        backoff: Callable[[int], float],
        check_open: Callable[[], None],
    ) -> None:
        self.addresses = addresses
        self.deadline_s = deadline_s
        self.retries = retries
        self._channels = channels
        self._backoff = backoff
        self._check_open = check_open
        self.current: str | None = None  # the address believed to lead
        self._next = 0  # round-robin position in `addresses`
        self._discovering: asyncio.Lock | None = None

    def read_target(self) -> str:
        """Where a read goes: the believed leader (the freshest answer), else the next address
        (reads are answered everywhere)."""
        return self.current or self.addresses[self._next % len(self.addresses)]

    def follow(self, address: str) -> None:
        """Another Conductor named `address` as the leader: use it from now."""
        self.current = address

    async def find(self) -> str:
        """Ask the Conductors who leads; returns the leader's address and uses it from now.
        Raises `Unavailable`."""
        async with self._lock():
            return await self._discover()

    async def ensure(self) -> str:
        """The believed leader, found first when there is none."""
        if self.current is not None:
            return self.current
        async with self._lock():  # one discovery for many concurrent callers
            leader = self.current  # another caller may have found it meanwhile
            return leader if leader is not None else await self._discover()

    def _lock(self) -> asyncio.Lock:
        if self._discovering is None:
            self._discovering = asyncio.Lock()
        return self._discovering

    async def _discover(self) -> str:
        """Find the leader: ask each address in turn; a leader another Conductor names is asked
        too, and only taken once it confirms (a standby's answer may be stale)."""
        last = "no answer"
        n = len(self.addresses)
        for round_ in range(self.retries + 1):
            if round_:
                await asyncio.sleep(self._backoff(round_ - 1))
            asked: set[str] = set()
            for _ in range(n):
                address = self.addresses[self._next % n]
                if address not in asked:
                    asked.add(address)
                    answer = await self._ask_leader(address)
                    if isinstance(answer, str):
                        last = answer
                    elif answer.is_leader:
                        self.current = address  # the address we reached beats the advertised one
                        return address
                    else:
                        named = normalize_address(answer.leader_url)
                        last = f"{address}: not the leader; leader {named or '(election running)'}"
                        if named and named not in asked:
                            asked.add(named)
                            confirm = await self._ask_leader(named)
                            if isinstance(confirm, str):
                                last = confirm
                            elif confirm.is_leader:
                                self.current = named
                                return named
                self._next += 1
        raise Unavailable(
            grpc.StatusCode.UNAVAILABLE,
            f"no Conductor leader found at {', '.join(self.addresses)}; last: {last}",
        )

    async def _ask_leader(self, address: str) -> pb.GetLeaderResponse | str:
        """GetLeader at one address, or why it did not answer."""
        self._check_open()
        try:
            return await self._channels.stub(address).GetLeader(
                pb.GetLeaderRequest(), timeout=self.deadline_s
            )
        except grpc.RpcError as err:
            failure = from_rpc_error(err)
            return f"{address}: {failure.code.name} {failure.message}"
        except aio.UsageError as err:  # the channel was closed under the call
            raise ConductorError(grpc.StatusCode.CANCELLED, str(err)) from None

    def forget(self, address: str) -> None:
        """`address` failed: stop treating it as the leader and move reads elsewhere."""
        if self.current == address:
            self.current = None
        if self.addresses[self._next % len(self.addresses)] == address:
            self._next += 1
