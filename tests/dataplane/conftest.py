"""Fixtures of the KV data plane's tests, borrowed from the services' tests: a simulated
engine served in this process (the engine tests' `start_engine`, for the pool link), and
Messengers as processes with their Conductor clients and an HTTP session (the Messenger
tests' `start_messenger_process`, `client_of` and `http`, for the transfers between
Messengers)."""

from __future__ import annotations

from tests.engine.conftest import start_engine
from tests.messenger.conftest import client_of, http, start_messenger_process

__all__ = ["client_of", "http", "start_engine", "start_messenger_process"]
