"""The simulated engine in process, for the peer routers to stand in front of."""

from tests.engine.conftest import start_engine

__all__ = ["start_engine"]
