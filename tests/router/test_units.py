"""The Router's pure parts: keys and tenants, salts, usage parsing, body rewriting, the
fallback's choices, settings."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest

from services.common.inference_api.openai_api import ApiError
from services.router import api_keys
from services.router.auth import ANONYMOUS, Authenticator, Tenant, key_digest
from services.router.client_ids import session_key
from services.router.kv_moves import prefill_body
from services.router.local_placement import rendezvous
from services.router.metrics import RouterMetrics
from services.router.placement import KnownInstance, PlacementQuery
from services.router.placer import Placer
from services.router.proxy import with_cache_salt
from services.router.session_hosts import SessionHosts
from services.router.settings import parse
from services.router.usage import Usage, from_body, from_sse_tail


def test_the_keys_tool_creates_and_extends_a_file_of_digests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    assert api_keys.main(["new", "--tenant", "acme", "--file", str(path)]) == 0
    first = capsys.readouterr().out.strip()
    assert api_keys.main(["new", "--tenant", "acme", "--file", str(path)]) == 0
    second = capsys.readouterr().out.strip()
    assert api_keys.main(["new", "--tenant", "globex", "--file", str(path)]) == 0
    third = capsys.readouterr().out.strip()
    assert len({first, second, third}) == 3
    text = path.read_text()
    assert first not in text and second not in text  # only digests are stored
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = json.loads(text)
    assert data["tenants"]["acme"]["keys"] == [key_digest(first), key_digest(second)]
    auth = Authenticator.from_file(path)
    acme = auth.tenant(f"Bearer {first}")
    assert acme == auth.tenant(f"bearer {second}") and acme.name == "acme"
    globex = auth.tenant(f"Bearer {third}")
    assert globex.name == "globex" and globex.salt and globex.salt != acme.salt
    assert acme.salt not in repr(acme)  # salts stay out of logs


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic abc", "Bearer nope"])
def test_a_missing_or_unknown_key_is_401(tmp_path: Path, header: str | None) -> None:
    path = tmp_path / "keys.json"
    api_keys.new_key(path, "acme")
    with pytest.raises(ApiError) as err:
        Authenticator.from_file(path).tenant(header)
    assert err.value.status == 401
    assert err.value.body()["error"]["code"] == "invalid_api_key"


def test_a_broken_keys_file_is_refused_without_echoing_it(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text('{"tenants": {"a": {"salt": "s3cret", "keys": ["sha256:short"]}}}')
    with pytest.raises(ValueError, match="sha256") as err:
        Authenticator.from_file(path)
    assert "s3cret" not in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        Authenticator.from_file(tmp_path / "missing.json")


def test_without_keys_every_request_is_the_anonymous_tenant() -> None:
    auth = Authenticator.open()
    assert auth.tenant(None) is ANONYMOUS and auth.tenant("Bearer whatever") is ANONYMOUS


def test_cache_salts_combine_tenant_and_client() -> None:
    assert Tenant("t", "ts").cache_salt(None) == "ts"
    assert Tenant("t", "ts").cache_salt("c") == "ts:c"
    assert Tenant("t", "").cache_salt("c") == "c"
    assert Tenant("t", "").cache_salt(None) == ""


def test_the_body_keeps_its_bytes_and_gets_the_salt() -> None:
    raw = b'{"prompt": "hi",  "x_unknown": {"nested": [1, 2.50]}}\n'
    body = json.loads(raw)
    assert with_cache_salt(raw, body, "") is raw
    out = with_cache_salt(raw, body, 'te"nant')
    assert out.startswith(b'{"prompt": "hi",  "x_unknown": {"nested": [1, 2.50]}')
    assert json.loads(out) == {**body, "cache_salt": 'te"nant'}
    assert json.loads(with_cache_salt(b"{ }", {}, "s")) == {"cache_salt": "s"}
    salted = b'{"prompt": "hi", "cache_salt": "c"}'
    assert with_cache_salt(salted, json.loads(salted), "c") is salted
    assert json.loads(with_cache_salt(salted, json.loads(salted), "t:c"))["cache_salt"] == "t:c"
    # No salt: no member at all (vLLM refuses an empty cache_salt).
    empty = b'{"prompt": "hi", "cache_salt": ""}'
    assert json.loads(with_cache_salt(empty, json.loads(empty), "")) == {"prompt": "hi"}


def test_usage_comes_from_the_body_or_the_streams_tail() -> None:
    usage = {
        "prompt_tokens": 30,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    assert from_body(json.dumps({"usage": usage}).encode()) == Usage(30, 5, 16)
    assert from_body(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2}}') == Usage(3, 2, 0)
    assert from_body(b"not json") is None
    tail = (
        b'ices": [{"text": "x"}]}\n\n'  # the tail may start mid-event
        b'data: {"choices": [], "usage": ' + json.dumps(usage).encode() + b"}\n\n"
        b"data: [DONE]\n\n"
    )
    assert from_sse_tail(tail) == Usage(30, 5, 16)
    assert from_sse_tail(b'data: {"choices": [], "usage": null}\n\ndata: [DONE]\n\n') is None


def test_the_fallback_hashes_sessions_and_spreads_the_rest() -> None:
    instances = [
        KnownInstance(f"node-{i}/engine-0", f"http://127.0.0.1:{9000 + i}") for i in range(4)
    ]
    sessions = [f"tenant/s{i}" for i in range(200)]
    first = [rendezvous(instances, s) for s in sessions]
    assert first == [rendezvous(list(reversed(instances)), s) for s in sessions]  # order-free
    assert len(set(first)) == 4  # spread
    # Removing an instance moves only the sessions it had.
    gone = instances[1]
    rest = [i for i in instances if i != gone]
    for session, before in zip(sessions, first, strict=True):
        if before != gone:
            assert rendezvous(rest, session) == before


def test_least_in_flight_and_suspects() -> None:
    client: Any = _NoClient()  # the fallback never calls the Conductor
    placer = Placer(
        client, RouterMetrics(), timeout_s=0.1, refresh_s=1.0, suspect_s=5.0, clock=lambda: now
    )
    now = 0.0
    placer._instances = tuple(KnownInstance(f"i{i}", f"http://h{i}") for i in range(3))
    q = PlacementQuery("r", 10, 1, b"", "")
    placer.begin("i0")
    placer.begin("i1")
    assert placer.fallback(q, "timeout").instance_id == "i2"
    placer.suspect("i2")
    placer.end("i1")
    assert placer.fallback(q, "timeout").instance_id == "i1"
    now = 6.0  # the suspicion lapsed
    assert {placer.fallback(q, "timeout").instance_id for _ in range(4)} >= {"i1", "i2"}
    with pytest.raises(ApiError) as err:
        placer.fallback(q, "refused", exclude=("i0", "i1", "i2"))
    assert (err.value.status, err.value.response().headers["Retry-After"]) == (503, "1")
    assert placer.fallback_decisions == 2 + 4


def test_the_fallback_keeps_a_session_where_the_conductor_last_placed_it() -> None:
    client: Any = _NoClient()
    placer = Placer(client, RouterMetrics(), timeout_s=0.1, refresh_s=1.0)
    placer._instances = tuple(KnownInstance(f"i{i}", f"http://h{i}") for i in range(4))
    q = PlacementQuery("r", 10, 1, b"", "tenant/s")
    hashed = placer.fallback(q, "timeout")
    assert hashed.rule == "fallback_session_hash"
    bound = next(i.instance_id for i in placer._instances if i.instance_id != hashed.instance_id)
    placer._session_hosts.placed("tenant/s", bound)  # as a Conductor decision records it
    kept = placer.fallback(q, "timeout")
    assert (kept.instance_id, kept.rule) == (bound, "fallback_session_last_host")
    placer.suspect(bound)  # gone: the hash again
    assert placer.fallback(q, "timeout").instance_id == hashed.instance_id


def test_session_hosts_forget_the_least_recently_placed_first() -> None:
    hosts = SessionHosts(capacity=2)
    hosts.placed("a", "i0")
    hosts.placed("b", "i1")
    hosts.placed("a", "i2")  # a is now the most recent
    hosts.placed("c", "i0")
    assert (hosts.host("a"), hosts.host("b"), hosts.host("c"), len(hosts)) == ("i2", None, "i0", 2)
    hosts.placed("", "i0")  # no session: nothing to remember
    assert len(hosts) == 2
    with pytest.raises(ValueError, match="negative"):
        SessionHosts(capacity=-1)


class _NoClient:
    deadline_s = 1.0
    current_leader = None


def test_settings_need_keys_or_an_explicit_no_auth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSCHED_ROUTER_INSECURE", "1")  # plaintext: what this test is not about
    with pytest.raises(SystemExit) as exited:
        parse([])
    assert exited.value.code == 2
    assert "--no-auth" in capsys.readouterr().err
    s = parse(["--no-auth", "--conductor", "a:1, b:2", "--placement-timeout", "0.5"])
    assert s.no_auth and s.conductors == ("a:1", "b:2") and s.placement_timeout_s == 0.5
    s = parse(["--no-auth", "--model-alias", "fast=m-1, small = m-2"])
    assert s.model_aliases == (("fast", "m-1"), ("small", "m-2"))
    for bad in ("fast", "=m", "fast="):
        with pytest.raises(SystemExit):
            parse(["--no-auth", "--model-alias", bad])
    monkeypatch.setenv("KVSCHED_ROUTER_API_KEYS", str(tmp_path / "k.json"))
    monkeypatch.setenv("KVSCHED_ROUTER_MAX_MODEL_LEN", "4096")
    s = parse([])
    assert s.api_keys == str(tmp_path / "k.json") and s.max_model_len == 4096 and not s.no_auth


def test_session_keys_are_scoped_by_tenant_and_safe_as_header_values() -> None:
    assert session_key("acme", "chat-7") == "acme/chat-7"
    assert session_key("acme", "agent:1/turn@x") == "acme/agent:1/turn@x"
    odd = session_key("acme", "a b\r\nx-evil: 1\ud800é%")
    assert odd.isascii() and odd.isprintable() and " " not in odd
    assert odd != session_key("globex", "a b\r\nx-evil: 1\ud800é%")


def test_a_hand_offs_prefill_asks_one_token_and_no_stream() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 90,
            "max_completion_tokens": 90, "stream": True, "stream_options": {"include_usage": 1},
            "cache_salt": "s", "temperature": 0.2}  # fmt: skip
    assert prefill_body(body) == {"model": "m", "messages": body["messages"], "max_tokens": 1,
                                  "max_completion_tokens": 1, "cache_salt": "s",
                                  "temperature": 0.2}  # fmt: skip
    assert prefill_body({"prompt": "x"}) == {"prompt": "x", "max_tokens": 1}
    with pytest.raises(ValueError, match="not a JSON object"):
        prefill_body(["not", "an", "object"])


def test_settings_need_mutual_tls_or_insecure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["--no-auth"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--grpc-tls-client-ca" in err and "--conductor-cert" in err and "--insecure" in err
    mutual = ["--grpc-tls-cert", "r.pem", "--grpc-tls-key", "r.key", "--grpc-tls-client-ca", "ca"]
    mutual += ["--conductor-ca", "ca", "--conductor-cert", "r.pem", "--conductor-key", "r.key"]
    s = parse(["--no-auth", *mutual])
    assert s.grpc_tls is not None and s.conductor_tls is not None
    assert s.conductor_tls.cert_file == "r.pem"
