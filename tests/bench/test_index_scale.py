"""`bench.index_scale` and the workload it shares with the placement benches: the draws, the
capacity arithmetic, and a tiny run of the whole bench so it cannot rot."""

from __future__ import annotations

import random
import re

import pytest

from bench.index_scale import Capacity, main
from bench.prefix_workload import CHAIN, SYSTEM, draw_chains, draw_loads, draw_prompt


def test_chains_stop_at_the_asked_blocks_and_half_share_the_system_prefix() -> None:
    pairs = list(draw_chains(random.Random(3), 100 * CHAIN, 8))
    assert len(pairs) == 100
    assert all(0 <= slot < 8 and len(chain) == CHAIN for slot, chain in pairs)
    system = [chain[:SYSTEM] for _, chain in pairs]
    shared = max(system, key=system.count)
    assert 30 <= system.count(shared) <= 70  # SYSTEM_SHARE 0.5 of 100 chains


def test_the_same_seed_draws_the_same_workload() -> None:
    def draw(seed: int) -> tuple[object, ...]:
        rng = random.Random(seed)
        chains = [c for _, c in draw_chains(rng, 10 * CHAIN, 4)]
        return tuple(map(tuple, chains)), draw_loads(rng, 4), draw_prompt(rng, chains, 2048)

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_a_prompt_continues_part_of_an_indexed_chain() -> None:
    rng = random.Random(5)
    chains = [c for _, c in draw_chains(rng, 4 * CHAIN, 2, share=0.0)]
    for _ in range(20):
        prompt = draw_prompt(rng, chains, 2048)
        assert len(prompt) == 2048
        source = next(c for c in chains if c[0] == prompt[0])
        hit = next(i for i, (a, b) in enumerate(zip(prompt, source, strict=False)) if a != b)
        assert 1 <= hit <= CHAIN and all(0 <= h < 2**64 for h in prompt)


def test_capacity_adds_the_per_placement_costs() -> None:
    cap = Capacity(decision_ms=0.25, grpc_ms=1.0, upkeep_ms=0.75, instance_rate=0.8)
    assert cap.conductor_rate == pytest.approx(500.0)
    assert cap.instances_at(0.8) == 625
    assert cap.instances_at(10.0) == 50


@pytest.mark.slow
def test_a_tiny_run_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "--blocks", "20000", "--instances", "32", "--baseline-instances", "4",
            "--decisions", "20", "--policies", "cache_aware,elastic", "--profile", "elastic",
            "--event-rounds", "4",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    for name in ("index.match", "cache_aware", "elastic"):
        row = re.search(
            rf"^{re.escape(name)}\s+([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)x$", out, re.M
        )
        assert row is not None, name
        assert all(float(v) > 0 for v in row.groups())
    assert re.search(r"^ +32 +[\d.]+ +\d+ ", out, re.M)  # the large index's memory row
    for path in ("ints", "packed"):
        assert re.search(
            rf"one Conductor \(elastic over 32 instances, events by the {path} path\).* "
            r"serves [\d,]+ such",
            out,
        )
        event = re.search(rf"^ +32 +{path} +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)x$", out, re.M)
        assert event is not None and all(float(v) > 0 for v in event.groups())
    assert "profile of elastic over 32 instances" in out
