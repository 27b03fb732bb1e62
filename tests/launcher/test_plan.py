"""`kvsched up`'s plan: what it starts, on which ports, and the endpoints file it writes."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from services.launcher import vllm_flags
from services.launcher.__main__ import build_parser, cluster_options
from services.launcher.cluster_options import ClusterOptions
from services.launcher.plan import STAGES, plan_cluster
from services.launcher.vllm import REPO


def test_default_cluster_shape_and_endpoints_schema(tmp_path: Path) -> None:
    plan = plan_cluster(ClusterOptions(), tmp_path, tmp_path / "keys.json", "sk-test")
    counts = {stage: len(plan.stage(stage)) for stage in STAGES}
    assert counts == {"etcd": 1, "conductor": 1, "engine": 4, "messenger": 2, "router": 2}
    pids = {c.name: 100 + i for i, c in enumerate(plan.children)}
    ep = plan.endpoints(pids)
    assert set(ep) >= {"model", "etcd", "conductors", "routers", "messengers", "engines"}
    assert set(ep["etcd"]) >= {"url", "pid"}
    assert all(set(c) >= {"url", "http_url", "pid"} for c in ep["conductors"])
    assert all(set(r) >= {"url", "pid"} for r in ep["routers"])
    assert all(set(m) >= {"url", "pid", "node"} for m in ep["messengers"])
    assert all(set(e) >= {"id", "url", "pid", "node"} for e in ep["engines"])
    assert sorted(e["pid"] for e in ep["engines"]) == sorted(
        pids[c.name] for c in plan.stage("engine")
    )
    assert {e["node"] for e in ep["engines"]} == {m["node"] for m in ep["messengers"]}


def test_every_listener_has_its_own_loopback_port(tmp_path: Path) -> None:
    plan = plan_cluster(ClusterOptions(conductors=2, routers=3), tmp_path, tmp_path / "k", "")
    listens = [
        arg
        for c in plan.children
        for flag, arg in zip(c.argv, c.argv[1:], strict=False)
        if flag in {"--listen", "--http-listen", "--grpc-listen", "--kv-events", "--kv-replay"}
    ]
    listens += [
        arg.split("=", 1)[1] for c in plan.children for arg in c.argv if arg.startswith("--listen-")
    ]
    ports = [int(p) for arg in listens for p in re.findall(r"127\.0\.0\.1:(\d+)", arg)]
    assert len(ports) == len(listens) == len(set(ports)) > 20
    assert all("0.0.0.0" not in arg for c in plan.children for arg in c.argv)


def test_messengers_own_their_nodes_engines(tmp_path: Path) -> None:
    plan = plan_cluster(ClusterOptions(nodes=3, engines_per_node=2), tmp_path, tmp_path / "k", "")
    for messenger in plan.stage("messenger"):
        node = messenger.endpoint["node"]
        argv = messenger.argv
        engines = [argv[i + 1] for i, flag in enumerate(argv) if flag == "--engine"]
        assert engines == [
            f"{e.endpoint['url']},kind=sim"
            for e in plan.stage("engine")
            if e.endpoint["node"] == node
        ]


def test_vllm_engines_get_every_flag_kvsched_needs(tmp_path: Path) -> None:
    opts = ClusterOptions(
        engine="vllm", model_dir=tmp_path / "tiny", model="tiny", block_size=32, nodes=1
    )
    plan = plan_cluster(opts, tmp_path, tmp_path / "k", "")
    engines = plan.stage("engine")
    argv = engines[0].argv
    assert argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
    assert (_flag(argv, "--model"), _flag(argv, "--served-model-name")) == (
        str(tmp_path / "tiny"),
        "tiny",
    )
    assert _flag(argv, "--block-size") == "32" and _flag(argv, "--prefix-caching-hash-algo")
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--enable-server-load-tracking"):  # fmt: skip
        assert flag in argv
    events = json.loads(_flag(argv, "--kv-events-config"))
    assert events["enable_kv_cache_events"] and events["replay_endpoint"].startswith("tcp://")
    assert engines[0].ready_timeout_s > 60 and "VLLM_CPU_KVCACHE_SPACE" in engines[0].env
    (messenger,) = plan.stage("messenger")
    assert _flag(messenger.argv, "--engine").endswith(
        f",kind=vllm,id={engines[0].endpoint['id']},role=both"
    )
    for router in plan.stage("router"):
        assert _flag(router.argv, "--tokenizer") == str(tmp_path / "tiny")
    # kvsched's KV connector, on the socket of its node's pool, importable by vLLM.
    socket = _flag(messenger.argv, "--kv-pool-socket")
    assert int(_flag(messenger.argv, "--kv-pool-bytes")) > 0 and len(socket) < 108
    connector = json.loads(_flag(argv, "--kv-transfer-config"))
    assert connector["kv_connector_module_path"] == "services.vllm_connector.connector"
    assert connector["kv_connector_extra_config"]["pool_socket"] == socket
    assert connector["kv_load_failure_policy"] == "recompute"
    assert engines[0].env["PYTHONPATH"] == str(REPO)


def test_each_node_has_its_own_pool_socket_and_no_pool_means_no_connector(
    tmp_path: Path,
) -> None:
    opts = ClusterOptions(engine="vllm", model_dir=tmp_path, block_size=32, nodes=2)
    plan = plan_cluster(opts, tmp_path, tmp_path / "k", "")
    sockets = {_flag(m.argv, "--kv-pool-socket") for m in plan.stage("messenger")}
    assert len(sockets) == 2
    bare = plan_cluster(replace(opts, kv_pool_bytes=0), tmp_path, tmp_path / "k", "")
    assert all("--kv-transfer-config" not in e.argv for e in bare.stage("engine"))
    assert all("--kv-pool-socket" not in m.argv for m in bare.stage("messenger"))


def test_two_models_get_their_engines_on_every_node_and_the_routers_both_tokenizers(
    tmp_path: Path,
) -> None:
    args = ["--engine", "vllm", "--model", str(tmp_path / "tiny-llama"), "--model"]
    args += [str(tmp_path / "tiny-qwen2"), "--nodes", "2", "--engines-per-node", "2"]
    plan = plan_cluster(cluster_options(build_parser().parse_args(args)), tmp_path, tmp_path, "")
    engines = plan.stage("engine")
    served = [(e.endpoint["node"], _flag(e.argv, "--served-model-name")) for e in engines]
    assert sorted(served) == sorted(
        (f"node-{n}", m) for n in range(2) for m in ("tiny-llama", "tiny-qwen2") for _ in range(2)
    )
    assert len({e.endpoint["id"] for e in engines}) == 8
    assert len({e.env["VLLM_CPU_OMP_THREADS_BIND"] for e in engines}) >= 2  # cores shared out
    for messenger in plan.stage("messenger"):
        assert messenger.argv.count("--engine") == 4  # both models' engines of its node
    for router in plan.stage("router"):
        assert _flag(router.argv, "--model") == "tiny-llama"
        assert _flag(router.argv, "--model-tokenizer") == f"tiny-qwen2={tmp_path / 'tiny-qwen2'}"
    assert plan.endpoints({})["models"] == ["tiny-llama", "tiny-qwen2"]
    with pytest.raises(ValueError, match="serve the same name"):
        cluster_options(build_parser().parse_args([*args[:5], str(tmp_path / "tiny-llama")]))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"engine": "vllm"}, "needs --model"), ({"engine": "tgi"}, "--engine"),
     ({"engine": "vllm", "model_dir": Path("m")}, "multiples of 32"),
     ({"engine": "vllm", "model_dir": Path("m"), "block_size": 32, "policy": "static_pd",
       "kv_pool_bytes": 0}, "KV pools"),
     ({"policy": "static_pd", "kv_pool_bytes": 0}, "KV pools"),
     ({"engine": "vllm", "model_dir": Path("m"), "block_size": 32, "kv_pool_bytes": -1},
      "must not be negative")],
)  # fmt: skip
def test_clusters_refuse_what_cannot_work(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ClusterOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["conductors", "routers", "nodes", "engines_per_node"])
def test_refuses_empty_roles(field: str) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ClusterOptions(**{field: 0})  # type: ignore[arg-type]


def _flag(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize(
    ("policy", "roles"),
    [
        ("elastic", ["both"] * 4),
        ("static_pd", ["prefill", "prefill", "decode", "decode"]),
        ("mooncake:colocated=1", ["both"] * 4),
        ("static_pd:prefill_share=0.25", ["prefill", "decode", "decode", "decode"]),
    ],
)
def test_engines_take_the_roles_their_policy_wants(
    tmp_path: Path, policy: str, roles: list[str]
) -> None:
    plan = plan_cluster(ClusterOptions(policy=policy), tmp_path, tmp_path / "k", "")
    assert [_flag(e.argv, "--role") for e in plan.stage("engine")] == roles


def test_engines_and_the_conductor_model_the_same_kv(tmp_path: Path) -> None:
    opts = ClusterOptions(transfer_backend="tcp", messenger_flags=("--transfer-rate=1e6",))
    plan = plan_cluster(opts, tmp_path, tmp_path / "k", "")
    (conductor,) = plan.stage("conductor")
    assert _flag(conductor.argv, "--model") == opts.model_config
    assert {_flag(e.argv, "--model-config") for e in plan.stage("engine")} == {opts.model_config}
    for messenger in plan.stage("messenger"):
        assert _flag(messenger.argv, "--transfer-backend") == "tcp"
        assert "--transfer-rate=1e6" in messenger.argv
    assert plan.endpoints({})["model_config"] == opts.model_config


def test_a_latency_profile_reaches_the_conductors_the_engines_and_the_endpoints(
    tmp_path: Path,
) -> None:
    args = build_parser().parse_args(["--latency-profile", "llama-3-8b-a100"])
    plan = plan_cluster(cluster_options(args), tmp_path, tmp_path / "k", "")
    (conductor,) = plan.stage("conductor")
    assert _flag(conductor.argv, "--latency-profile") == "llama-3-8b-a100"
    assert {_flag(e.argv, "--latency-profile") for e in plan.stage("engine")} == {"llama-3-8b-a100"}
    assert plan.endpoints({})["latency_profile"] == "llama-3-8b-a100"
    default = plan_cluster(ClusterOptions(), tmp_path, tmp_path / "k", "")
    assert "--latency-profile" not in default.stage("conductor")[0].argv
    assert "latency_profile" not in default.endpoints({})
    with pytest.raises(ValueError, match="no latency profile named"):
        ClusterOptions(latency_profile="h200-dreams")


def test_refuses_unknown_models_and_policies() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        ClusterOptions(model_config="nope/none")
    with pytest.raises(ValueError, match="unknown policy"):
        ClusterOptions(policy="nope")


def _value(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_by_default_every_process_has_its_own_identity_and_serves_mutual_tls(
    tmp_path: Path,
) -> None:
    plan = plan_cluster(ClusterOptions(conductors=2), tmp_path, tmp_path / "k", "")
    creds = plan.credentials
    assert creds is not None and creds.folder == tmp_path / "tls"
    expected = {
        "conductor": ("--tls-cert", "--messenger-tls-cert"),
        "messenger": ("--serve-tls-cert", "--tls-cert"),
        "router": ("--grpc-tls-cert", "--conductor-cert"),
    }
    names = {"conductor": "conductor-0", "messenger": "node-0", "router": "router-0"}
    for stage, (serves, calls) in expected.items():
        for child in plan.stage(stage):
            assert "--insecure" not in child.argv
            assert _value(child.argv, serves) == _value(child.argv, calls)  # one identity
        first = plan.stage(stage)[0]
        assert _value(first.argv, serves).endswith(f"{stage}-{names[stage]}.pem")
    conductor = plan.stage("conductor")[1]
    assert _value(conductor.argv, "--admin-token-file") == str(creds.admin_token_file)
    assert conductor.env["KVSCHED_ETCD_CERT_FILE"].endswith("conductor-conductor-1.pem")
    etcd = plan.stage("etcd")[0]
    assert etcd.endpoint["url"].startswith("https://") and "--client-cert-auth" in etcd.argv
    assert conductor.env["KVSCHED_ETCD_ENDPOINTS"] == etcd.endpoint["url"]
    admin = plan.endpoints({})["admin"]
    assert admin["cert"].endswith("admin-operator.pem") and admin["token_file"]


def test_insecure_runs_plaintext_without_credentials(tmp_path: Path) -> None:
    plan = plan_cluster(ClusterOptions(insecure=True), tmp_path, tmp_path / "k", "")
    assert plan.credentials is None and "admin" not in plan.endpoints({})
    for child in plan.children:
        flags = [arg.split("=")[0] for arg in child.argv if arg.startswith("--")]
        assert not any("tls" in flag or "cert" in flag for flag in flags)
        if child.stage in ("conductor", "messenger", "router"):
            assert "--insecure" in child.argv
    assert plan.stage("etcd")[0].endpoint["url"].startswith("http://")


@pytest.mark.parametrize(
    ("flags", "block_size"),
    [
        ([], 16),
        (["--engine", "vllm", "--model", "m"], 32),  # what vLLM's CPU attention takes
        (["--engine", "vllm", "--model", "m", "--block-size", "64"], 64),
    ],
)
def test_a_block_size_the_engines_take_when_none_is_given(
    flags: list[str], block_size: int
) -> None:
    assert cluster_options(build_parser().parse_args(flags)).block_size == block_size


def test_vllm_flags_prints_what_kvsched_up_starts_its_engines_with(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert vllm_flags.main(["--model", "m/tiny", "--kv-pool-socket", "/run/pool.sock"]) == 0
    out = capsys.readouterr().out.splitlines()
    argv = shlex.split(out[1])
    assert argv[:3] == ["vllm", "serve", "m/tiny"]
    opts = ClusterOptions(
        engine="vllm", model_dir=Path("m/tiny"), model="tiny", block_size=32, nodes=1
    )
    up = plan_cluster(opts, Path("run"), Path("keys"), "").stage("engine")[0].argv
    for flag in ("--block-size", "--prefix-caching-hash-algo", "--served-model-name"):
        assert _flag(tuple(argv), flag) == _flag(up, flag)
    config = json.loads(_flag(tuple(argv), "--kv-transfer-config"))
    assert config["kv_connector_extra_config"]["pool_socket"] == "/run/pool.sock"
    assert "--enforce-eager" not in argv
    assert any(line.startswith("kvsched messenger --engine") for line in out)


def test_lora_adapters_load_at_run_time_and_routers_hash_with_their_paths(tmp_path: Path) -> None:
    adapters = {}
    for name, rank in (("a", 8), ("b", 64)):
        adapters[name] = tmp_path / name
        adapters[name].mkdir()
        (adapters[name] / "adapter_config.json").write_text(json.dumps({"r": rank}))
    args = ["--engine", "vllm", "--model", str(tmp_path / "tiny-llama"), "--model"]
    args += [str(tmp_path / "tiny-qwen2"), "--nodes", "1", "--max-loras", "3"]
    args += [f"--lora={name}={path}" for name, path in adapters.items()]
    plan = plan_cluster(cluster_options(build_parser().parse_args(args)), tmp_path, tmp_path, "")
    with_lora = [e for e in plan.stage("engine") if "--enable-lora" in e.argv]
    assert {_flag(e.argv, "--served-model-name") for e in with_lora} == {"tiny-llama"}
    assert len(with_lora) == 2  # the first model's engines, not the second's
    for engine in with_lora:
        assert _flag(engine.argv, "--max-loras") == "3"
        assert _flag(engine.argv, "--max-lora-rank") == "64"  # b's rank: over vLLM's 16
        assert engine.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    (messenger,) = plan.stage("messenger")
    assert sum("max_loras=3" in a for a in messenger.argv) == 2
    for router in plan.stage("router"):
        assert _flag(router.argv, "--lora-modules") == f"a={adapters['a']},b={adapters['b']}"
    with pytest.raises(ValueError, match="a name of its own"):
        cluster_options(build_parser().parse_args([*args, f"--lora=a={adapters['b']}"]))
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        cluster_options(build_parser().parse_args([f"--lora=c={tmp_path}"]))


def test_an_embedding_model_gets_a_pooling_engine_on_every_node(tmp_path: Path) -> None:
    args = ["--engine", "vllm", "--model", str(tmp_path / "tiny-llama"), "--nodes", "2"]
    args += [f"--embedding-model=embed={tmp_path / 'tiny-llama'}"]
    plan = plan_cluster(cluster_options(build_parser().parse_args(args)), tmp_path, tmp_path, "")
    embedders = [e for e in plan.stage("engine") if "--runner" in e.argv]
    assert [e.endpoint["node"] for e in embedders] == ["node-0", "node-1"]
    for engine in embedders:
        assert _flag(engine.argv, "--runner") == "pooling"
        assert _flag(engine.argv, "--convert") == "embed"
        assert _flag(engine.argv, "--served-model-name") == "embed"
        assert "--kv-transfer-config" not in engine.argv and "--tool-call-parser" not in engine.argv
    for router in plan.stage("router"):
        assert _flag(router.argv, "--model-tokenizer") == f"embed={tmp_path / 'tiny-llama'}"
    with pytest.raises(ValueError, match="--engine vllm"):
        cluster_options(build_parser().parse_args([f"--embedding-model=embed={tmp_path}"]))
