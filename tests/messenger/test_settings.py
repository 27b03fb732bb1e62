"""Messenger flags, with their `KVSCHED_MESSENGER_*` environment defaults."""

from __future__ import annotations

import pytest

from services.common.security.tls import ClientTls
from services.dataplane.transfer import mooncake_backend
from services.messenger.engines import EngineTarget
from services.messenger.settings import parse


def test_flags_and_lists() -> None:
    s = parse(
        [
            "--conductor", "10.0.0.1:50051, 10.0.0.2:50051",
            "--engine", "http://127.0.0.1:8100,http://127.0.0.1:8101",
            "--engine", "http://127.0.0.1:8102",
            "--node", "node-7",
            "--instance-ttl", "6",
            "--tls-ca", "ca.pem", "--tls-cert", "me.pem", "--tls-key", "me.key",
            "--serve-tls-cert", "me.pem", "--serve-tls-key", "me.key",
            "--serve-tls-client-ca", "ca.pem",
        ]
    )  # fmt: skip
    assert s.conductors == ("10.0.0.1:50051", "10.0.0.2:50051")
    assert [e.url for e in s.engines] == [f"http://127.0.0.1:{p}" for p in (8100, 8101, 8102)]
    assert {e.kind for e in s.engines} == {"auto"}
    assert (s.node, s.instance_ttl_s, s.load_interval_s) == ("node-7", 6.0, 0.05)
    assert s.tls == ClientTls("ca.pem", "me.pem", "me.key")
    assert s.url == s.listen  # registered as each instance's Messenger


def test_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCHED_MESSENGER_INSECURE", "true")
    monkeypatch.setenv("KVSCHED_MESSENGER_ENGINE", "http://a:1,http://b:2")
    monkeypatch.setenv("KVSCHED_MESSENGER_CONDUCTOR", "c:1")
    monkeypatch.setenv("KVSCHED_MESSENGER_ENGINE_DEAD_AFTER", "2.5")
    s = parse([])
    assert ([e.url for e in s.engines], s.conductors, s.engine_dead_after_s) == (
        ["http://a:1", "http://b:2"],
        ("c:1",),
        2.5,
    )
    assert parse(["--engine", "http://c:3"]).engines == (EngineTarget("http://c:3"),)  # flag wins


def test_an_engine_takes_options_after_its_url() -> None:
    s = parse(
        ["--engine", "http://h:8000,kind=vllm,id=n-a,role=decode,events=tcp://h:5557,replay=tcp://h:5558",
         "--engine", "http://h:8001/,http://h:8002,kind=sim", "--insecure"]
    )  # fmt: skip
    assert s.engines == (
        EngineTarget("http://h:8000", "vllm", "n-a", "decode", "tcp://h:5557", "tcp://h:5558"),
        EngineTarget("http://h:8001"),
        EngineTarget("http://h:8002", "sim"),
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--load-interval", "0"],
        ["--mirror-batches", "-1"],
        ["--tls-cert", "me.pem"],
        ["--conductor", " , "],
        ["--engine", "kind=vllm"],
        ["--engine", "http://h:1,colour=red"],
        ["--engine", "h:1"],
        ["--engine", "http://h:1,kind=tgi"],
        ["--engine", "http://h:1,events=h:5"],
        ["--engine", "http://h:1,http://h:1"],
        ["--prefix-caching-hash-algo", "xxhash"],
    ],
)
def test_bad_values_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse([*argv, "--insecure"])  # refused for the value, not for plaintext


def test_mutual_tls_or_insecure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["--engine", "http://h:1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--serve-tls-client-ca" in err and "--tls-cert" in err and "--insecure" in err
    assert parse(["--engine", "http://h:1", "--insecure"]).server_tls is None


def test_the_mooncake_backend_without_its_wheel_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--insecure", "--conductor", "c:1", "--transfer-backend", "mooncake"]
    assert mooncake_backend.installed()  # the test environment has the extra
    assert parse(flags).transfer_backend == "mooncake"
    monkeypatch.setattr(mooncake_backend, "installed", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        parse(flags)
    assert exit_.value.code == 2
    assert "pip install 'kvsched[mooncake]'" in capsys.readouterr().err
