"""Hypothesis settings of the fuzz tests, and the fixtures of the cluster they fuzz.

The fuzz tests draw the same requests on every run (seeded by `derandomize`), so a green main
stays green; `pytest --hypothesis-profile=explore` draws ten times as many, new ones on every
run (keep what they find as focused tests)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from tests.messenger.conftest import start_messenger
from tests.router.conftest import (
    etcd,
    http,
    keys_file,
    registry,
    stack,
    start_conductor,
    start_engines,
    start_router,
)

__all__ = [  # fixtures re-exported for the tests here
    "etcd",
    "http",
    "keys_file",
    "registry",
    "stack",
    "start_conductor",
    "start_engines",
    "start_messenger",
    "start_router",
]

settings.register_profile(
    "fuzz",
    derandomize=True,
    deadline=None,  # an example is a batch of requests to a live server: its time varies
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz-explore",
    settings.get_profile("fuzz"),
    derandomize=False,
)

EXPLORE_FACTOR = 10


def exploring() -> bool:
    """Whether `--hypothesis-profile=explore` (tests/conftest.py's profile, not derandomized)
    is loaded: asked when a test runs, as this conftest may be imported before the profile is."""
    return not settings().derandomize


def fuzz_settings(examples: int) -> settings:
    """Settings for a fuzz test of `examples` examples (ten times as many, unseeded, when
    exploring)."""
    if exploring():
        return settings(
            settings.get_profile("fuzz-explore"), max_examples=examples * EXPLORE_FACTOR
        )
    return settings(settings.get_profile("fuzz"), max_examples=examples)
