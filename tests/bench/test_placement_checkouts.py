"""`bench.placement_checkouts`: a round of decisions made by a checkout's own code in a child
process, so the bench cannot rot."""

from __future__ import annotations

import pytest

from bench.common import REPO
from bench.placement_checkouts import main, run_round


@pytest.mark.slow
def test_a_round_in_this_checkout_times_and_records_every_decision() -> None:
    p50, decided = run_round(REPO, "elastic", 20, 1)
    again = run_round(REPO, "elastic", 20, 2)[1]
    assert p50 > 0
    assert len(decided) == 20
    assert again == decided  # the same code decides the same way on every pass


def test_a_round_count_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([str(REPO), "--rounds", "0"])
    assert exc.value.code == 2
    assert "--rounds, --decisions and --passes must be at least 1" in capsys.readouterr().err
