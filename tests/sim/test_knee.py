"""The knee by bisection: the bracket widens until it holds the crossing, the search halves
it to the tolerance, fractional copies keep the start window; a small search end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvsched.sim import cli
from kvsched.sim.compare import Comparison
from kvsched.sim.knee import KneeRun, KneeSearch, find_knee, run_knees
from kvsched.sim.knee_seeds import SeedParts, code_digest, run_key
from kvsched.sim.traces import transform
from tests.conftest import SLICES
from tests.sim.test_sweep import agentic


def cliff(knee: float) -> tuple[list[float], object]:
    """Attainment 0.95 up to `knee`, 0.5 past it; records the loads asked."""
    asked: list[float] = []

    def attainment(load: float) -> float:
        asked.append(load)
        return 0.95 if load <= knee else 0.5

    return asked, attainment


@pytest.mark.parametrize("knee", [30.0, 41.3, 63.9])
def test_bisection_locates_the_knee_to_the_tolerance(knee: float) -> None:
    asked, attainment = cliff(knee)
    out = find_knee(attainment, KneeSearch(24, 64, 0.02))  # type: ignore[arg-type]
    good, bad = out["goodput_load"], out["knee_load"]
    assert good <= knee < bad
    assert bad - good <= 0.02 * good
    assert asked[:2] == [24, 64] and len(asked) <= 9
    assert [p[0] for p in out["probes"]] == asked


def test_the_bracket_widens_down_and_up() -> None:
    asked, attainment = cliff(10.0)
    out = find_knee(attainment, KneeSearch(24, 64, 0.05))  # type: ignore[arg-type]
    assert asked[:3] == [24, 16, 10.67] and out["goodput_load"] <= 10 < out["knee_load"]
    asked, attainment = cliff(150.0)
    out = find_knee(attainment, KneeSearch(24, 64, 0.05))  # type: ignore[arg-type]
    assert asked[:4] == [24, 64, 96, 144] and out["goodput_load"] <= 150 < out["knee_load"]
    never = find_knee(lambda load: 0.1, KneeSearch(24, 64))
    assert never["goodput_load"] == 0.0
    always = find_knee(lambda load: float("nan") if load > 1e9 else 1.0, KneeSearch(24, 64))
    assert always["knee_load"] is None and always["goodput_load"] > 64


def test_a_bad_search_is_refused() -> None:
    with pytest.raises(ValueError, match="0 < lo < hi"):
        KneeSearch(64, 24)
    with pytest.raises(ValueError, match="tolerance"):
        KneeSearch(24, 64, 0.0)


def test_fractional_copies_add_a_seeded_sample_of_the_next_copy() -> None:
    base = agentic(groups=8)
    whole = transform.repeat_groups_fraction(base, 2.0, seed=0)
    assert len(transform.group_order(whole)) == 16
    part = transform.repeat_groups_fraction(base, 2.5, seed=0)
    groups = transform.group_order(part)
    assert len(groups) == 20 and part.notes["repeat"] == 2.5
    third = sorted(g for g in groups if g.endswith("#2"))
    assert len(third) == 4 and all(f"{g}#1" in groups for g in ("g0", "g7"))
    again = transform.repeat_groups_fraction(base, 2.5, seed=0)
    other = transform.repeat_groups_fraction(base, 2.5, seed=1)
    assert transform.group_order(again) == groups
    assert {g for g in transform.group_order(other) if g.endswith("#2")} != set(third)
    for call in part.calls:  # the sampled sessions' turns still follow one another
        assert call.after < 0 or part.calls[call.after].group == call.group


def two_policies(seeds: tuple[int, ...]) -> KneeRun:
    """round_robin and least_loaded on a small agentic trace, round_robin the reference."""
    base = agentic(groups=4, turns=3)
    cmp = Comparison(
        trace=base, trace_path="agentic", policies=("round_robin", "least_loaded"), instances=2,
        load=1.0, closed_loop=True, repeat=1,
    )  # fmt: skip
    return KneeRun(cmp, base, 1.0, KneeSearch(1, 16, 0.5), seeds, ("round_robin",))


def test_every_policys_knee_and_the_reference_rows() -> None:
    run = two_policies((0, 1))
    policies = run.base.policies
    report = run_knees(run, policies)
    assert set(report["seeds"]) == {"0", "1"}
    for seed in report["seeds"].values():
        reference = seed["reference_load"]
        assert reference == seed["policies"]["round_robin"]["goodput_load"] > 0
        apcs = [entry["at_reference"]["apc"] for entry in seed["policies"].values()]
        assert 0 < seed["apc_ceiling"] <= 1 and max(apcs) <= seed["apc_ceiling"] + 1e-12
        for entry in seed["policies"].values():
            assert entry["probes"][0][0] == 1.0
            assert entry["at_reference"]["slo_attainment"] is not None
            good = entry["goodput_load"]
            assert entry["rows"][f"{good:g}"]["slo_attainment"] >= 0.9
    # Shared among processes, the searches find the same (each replay is deterministic).
    assert run_knees(run, policies, jobs=2)["seeds"] == report["seeds"]


def test_a_probe_that_misses_stops_early_and_the_search_finds_the_same_knees() -> None:
    full = two_policies((0,))
    full = replace(full, search=replace(full.search, stop_early=False))
    policies = full.base.policies
    whole = run_knees(full, policies)["seeds"]["0"]
    early = run_knees(two_policies((0,)), policies)["seeds"]["0"]
    assert early["reference_load"] == whole["reference_load"]
    stopped = 0
    for name, entry in early["policies"].items():
        other = whole["policies"][name]
        assert entry["goodput_load"] == other["goodput_load"] > 0
        assert entry["knee_load"] == other["knee_load"]
        assert entry["at_reference"] == other["at_reference"]
        assert [load for load, _ in entry["probes"]] == [load for load, _ in other["probes"]]
        for load, row in entry["rows"].items():
            measured = other["rows"][load]["slo_attainment"]
            if row.get("stopped_early"):  # the most it could still reach, and below target
                stopped += 1
                assert measured <= row["slo_attainment"] < 0.9 and row["ttft_p90"] is None
            else:
                assert row == other["rows"][load]
    assert stopped > 0
    rows = [row for entry in whole["policies"].values() for row in entry["rows"].values()]
    assert not any(row.get("stopped_early") for row in rows)


def test_a_policy_not_searched_is_replayed_at_the_reference_load_only() -> None:
    run = two_policies((0,))
    policies = run.base.policies
    report = run_knees(run, policies, searched=("round_robin",))
    assert report["searched"] == ["round_robin"]
    seed = report["seeds"]["0"]
    unsearched = seed["policies"]["least_loaded"]
    assert unsearched["goodput_load"] is None and unsearched["probes"] == []
    assert list(unsearched["rows"]) == [f"{seed['reference_load']:g}"]
    searched_alone = run_knees(run, policies)["seeds"]["0"]["policies"]["least_loaded"]
    # The same replay as when it is searched: one prepared trace serves every policy.
    load = f"{seed['reference_load']:g}"
    assert unsearched["at_reference"] == searched_alone["rows"][load]
    with pytest.raises(ValueError, match="no reference baseline is searched"):
        run_knees(run, policies, searched=("least_loaded",))


def test_kvsched_knee_refuses_what_it_cannot_search(capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(SLICES / "weka_cc_agentic_sample.jsonl.xz")
    for extra, message in [
        (["--bracket", "8:2"], "0 < lo < hi"),
        (["--seeds", "x"], "--seeds"),
        (["--mode", "open"], "closed-loop"),
        (["--policies", "llmd,ear", "--search", "elastic"], "not in --policies"),
        (["--policies", "llmd,ear", "--search", "ear"], "every --reference policy"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["knee", "--trace", trace, "--out", "unused", *extra])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_a_run_goes_on_from_the_seeds_it_kept() -> None:
    run = two_policies((0, 1))
    policies = run.base.policies
    kept: dict[int, dict[str, Any]] = {}
    whole = run_knees(run, policies, on_seed=kept.__setitem__)
    assert set(kept) == {0, 1} and whole["seeds"] == {str(s): p for s, p in kept.items()}
    marker = {"reference_load": -1.0}  # no search makes this: the kept part is taken as it is
    searched: list[int] = []
    resumed = run_knees(
        run, policies, finished={0: marker}, on_seed=lambda s, _: searched.append(s)
    )
    assert resumed["seeds"] == {"0": marker, "1": whole["seeds"]["1"]}
    assert searched == [1]


def test_kvsched_knee_keeps_each_seed_and_a_changed_run_searches_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(SLICES / "weka_cc_agentic_sample.jsonl.xz")
    flags = ["knee", "--trace", trace, "--out", str(tmp_path), "--sessions", "0:2",
             "--instances", "2", "--policies", "round_robin,least_loaded", "--reference",
             "round_robin", "--bracket", "1:2", "--tolerance", "0.5", "--seeds", "0"]  # fmt: skip
    assert cli.main(flags) == 0
    first = json.loads((tmp_path / "knee.json").read_text())
    assert [p.name for p in (tmp_path / "seeds").iterdir()] == ["0.json"]
    capsys.readouterr()
    assert cli.main([*flags, "--jobs", "2"]) == 0  # how it runs is not what it finds
    assert "seeds 0 kept" in capsys.readouterr().err
    assert json.loads((tmp_path / "knee.json").read_text())["seeds"] == first["seeds"]
    parser = cli.build_parser()
    kept = cli.seed_parts(parser.parse_args(flags)).key
    assert cli.seed_parts(parser.parse_args([*flags, "--seeds", "0,1", "--quiet"])).key == kept
    assert cli.seed_parts(parser.parse_args([*flags, "--instances", "3"])).key != kept


def test_a_kept_seed_of_another_run_or_unreadable_is_not_taken(tmp_path: Path) -> None:
    parts = SeedParts(tmp_path, run_key({"load": 1}, code_digest()))
    parts.save(0, {"reference_load": 2.0})
    (tmp_path / "1.json").write_text("{not json")
    assert parts.load((0, 1, 2)) == {0: {"reference_load": 2.0}}
    assert SeedParts(tmp_path, run_key({"load": 2}, code_digest())).load((0,)) == {}
    assert run_key({"load": 1}, "other code") != parts.key
