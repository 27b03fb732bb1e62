"""The TLS flag groups: files read into the settings, incomplete groups refused."""

from __future__ import annotations

import argparse

import pytest

from services.common.flags import env_flags
from services.common.tls import ClientTls, ServerTls
from services.common.tls_flags import ClientTlsFlags, ServerTlsFlags

CLIENT = ClientTlsFlags("conductor-", "the Conductors")
SERVER = ServerTlsFlags("serve-tls-")


def _parse(argv: list[str]) -> tuple[ClientTls | None, ServerTls | None]:
    parser = argparse.ArgumentParser()
    flag = env_flags("KVSCHED_TEST_")
    CLIENT.add(flag, parser)
    SERVER.add(flag, parser)
    args = parser.parse_args(argv)
    return CLIENT.read(parser, args), SERVER.read(parser, args)


def test_no_flags_is_plaintext() -> None:
    assert _parse([]) == (None, None)


def test_the_files_named_are_the_settings() -> None:
    argv = ["--conductor-ca", "ca.pem", "--conductor-cert", "me.pem", "--conductor-key", "me.key"]
    argv += ["--serve-tls-cert", "s.pem", "--serve-tls-key", "s.key"]
    assert _parse(argv) == (
        ClientTls("ca.pem", "me.pem", "me.key"),
        ServerTls("s.pem", "s.key", None),
    )
    mutual = ["--serve-tls-cert", "s.pem", "--serve-tls-key", "s.key"]
    mutual += ["--serve-tls-client-ca", "ca.pem"]
    assert _parse(mutual)[1] == ServerTls("s.pem", "s.key", "ca.pem")
    assert _parse(["--conductor-ca", "ca.pem"])[0] == ClientTls("ca.pem")


@pytest.mark.parametrize(
    "argv",
    [
        ["--conductor-ca", "ca.pem", "--conductor-cert", "me.pem"],
        ["--conductor-cert", "me.pem", "--conductor-key", "me.key"],
        ["--serve-tls-cert", "s.pem"],
        ["--serve-tls-key", "s.key"],
    ],
)
def test_incomplete_groups_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        _parse(argv)
    assert stopped.value.code == 2
