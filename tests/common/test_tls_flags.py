"""The TLS flag groups: files read into the settings, incomplete groups refused."""

from __future__ import annotations

import argparse

import pytest

from services.common.security.tls import ClientTls, ServerTls
from services.common.security.tls_flags import (
    ClientTlsFlags,
    ServerTlsFlags,
    add_insecure,
    require_secure,
)
from services.common.serving.flags import env_flags

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


def _secure(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    flag = env_flags("KVSCHED_TEST_")
    CLIENT.add(flag, parser)
    SERVER.add(flag, parser)
    add_insecure(flag, parser)
    args = parser.parse_args(argv)
    require_secure(
        parser, args, (SERVER, SERVER.read(parser, args)), [(CLIENT, CLIENT.read(parser, args))]
    )


MUTUAL = ["--serve-tls-cert", "s.pem", "--serve-tls-key", "s.key", "--serve-tls-client-ca", "ca"]
CALLS = ["--conductor-ca", "ca", "--conductor-cert", "me.pem", "--conductor-key", "me.key"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "--serve-tls-cert, --serve-tls-key and --serve-tls-client-ca"),
        (MUTUAL, "--conductor-ca, --conductor-cert and --conductor-key"),
        (MUTUAL[:4] + CALLS, "--serve-tls-client-ca"),  # TLS without client certificates
        (MUTUAL + CALLS[:2], "--conductor-cert"),  # no certificate to present
        (["--insecure", *MUTUAL], "--insecure excludes"),
    ],
)
def test_a_service_is_secure_unless_told_insecure(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        _secure(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert says in err and ("--insecure" in err)


def test_mutual_tls_or_insecure_starts() -> None:
    _secure(MUTUAL + CALLS)
    _secure(["--insecure"])
