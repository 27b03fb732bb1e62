"""A replay's SLO verdict as it runs: which calls count as misses, and when it stops."""

from __future__ import annotations

import pytest

from kvsched.core.cluster import SloConfig
from kvsched.sim.verdict import SloVerdict, TargetOutOfReach


def test_misses_count_as_summarize_counts_them_and_end_the_run_once_the_target_is_lost() -> None:
    measured = [True, True, True, True, False]
    verdict = SloVerdict(measured, [1, 3, 3, 1, 1], SloConfig(ttft_s=2.0, tpot_s=0.1), 0.5)
    assert verdict.offered == 4
    verdict.refused(4)  # before the window: not offered
    verdict.first_token(0, 3.0)
    verdict.finished(0, 3.0, 10.0)  # its late first token was its one miss
    verdict.finished(1, 1.0, 0.2)  # 0.1 s a token after the first: met
    assert verdict.misses == 1 and verdict.attainment_bound == 0.75
    verdict.finished(2, 1.0, 0.4)  # 0.2 s a token: missed, and 2 of 4 may still reach 0.5
    assert verdict.misses == 2
    with pytest.raises(TargetOutOfReach):
        verdict.refused(3)
    assert verdict.attainment_bound == 0.25


def test_a_one_token_call_has_no_decode_to_miss() -> None:
    verdict = SloVerdict([True], [1], SloConfig(ttft_s=2.0, tpot_s=0.1), 0.9)
    verdict.finished(0, 1.0, 5.0)
    assert verdict.misses == 0
