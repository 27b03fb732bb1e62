"""How long a lease renewal waits for each Conductor."""

from __future__ import annotations

import pytest

from services.messenger.membership import attempt_deadline


def test_a_lone_conductor_is_waited_for_as_long_as_the_lease_lasts() -> None:
    assert attempt_deadline(2.0, 1.4, 1) == pytest.approx(1.4)


def test_the_time_left_is_shared_so_a_hung_conductor_leaves_time_for_the_next() -> None:
    assert attempt_deadline(2.0, 1.4, 2) == pytest.approx(0.7)
    assert 3 * attempt_deadline(3.0, 2.7, 3) == pytest.approx(2.7)


def test_an_attempt_waits_a_quarter_of_the_ttl_at_least() -> None:
    assert attempt_deadline(2.0, 0.1, 1) == 0.5  # late: one more try, not a hopeless one
    assert attempt_deadline(2.0, -1.0, 3) == 0.5  # lapsed by this clock: etcd decides
    assert attempt_deadline(2.0, 1.0, 0) == 1.0
