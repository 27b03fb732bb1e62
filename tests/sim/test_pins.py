"""Continuum's time-to-live pins on the simulated engine: pinned blocks survive memory
pressure, end with their time or their session's next turn, and give way to a request that
would otherwise starve."""

from __future__ import annotations

from kvsched.sim.engine import Engine
from tests.sim.test_engine import BS, drive, engine, job


def cached(eng: Engine, hashes: tuple[int, ...]) -> int:
    return eng.cache.match(hashes, len(hashes))


def served(pages: int = 40) -> tuple[Engine, tuple[int, ...]]:
    """An engine whose cache holds a 20-block session context, nothing locked."""
    eng = engine(pages=pages)
    first = job(1, 20 * BS, 1)
    drive(eng, [(0.0, first)])
    assert cached(eng, first.hashes) == 20
    return eng, first.hashes


def test_a_pinned_context_survives_memory_pressure_and_its_time_ends() -> None:
    eng, hashes = served()
    assert eng.retain(hashes, until=100.0, now=1.0) == 20
    drive(eng, [(2.0, job(2, 15 * BS, 1))])  # 15 + 20 pinned <= 40 pages: it fits beside
    assert cached(eng, hashes) == 20
    eng.plan(200.0)  # the next step after the time is up lets go
    assert not eng.pins
    drive(eng, [(201.0, job(3, 30 * BS, 1))])  # now the context may be evicted for room
    assert cached(eng, hashes) < 20


def test_without_a_pin_the_same_pressure_evicts_it() -> None:
    eng, hashes = served()
    drive(eng, [(2.0, job(2, 30 * BS, 1))])
    assert cached(eng, hashes) < 20


def test_the_sessions_next_turn_takes_over_the_pin() -> None:
    eng, hashes = served()
    eng.retain(hashes, until=100.0, now=1.0)
    drive(eng, [(2.0, job(4, 22 * BS, 1, (*hashes, 9000001, 9000002)))])
    assert not eng.pins  # admitted: it held its own prefix, the pin went
    assert eng.cache.locked == 0


def test_a_request_that_cannot_fit_beside_pins_frees_them() -> None:
    eng, hashes = served()
    eng.retain(hashes, until=100.0, now=1.0)
    big = job(5, 35 * BS, 1)  # needs 36 pages of 40 while 20 are pinned and nothing runs
    done = drive(eng, [(2.0, big)])
    assert done == [big] and eng.pins_freed_early == 1 and not eng.pins
