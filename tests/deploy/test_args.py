"""The overlays run what `kvsched up` runs: each committed args.yaml is what
`services.launcher.deploy_args` makes of `plan_cluster` today; the rendered dev overlay has
the shape of `kvsched up`'s default cluster and, container by container, the flags of its
processes, with the same values but for addresses and paths; the production vLLM pods run
`VllmServer.argv()` to the letter."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from services.launcher import deploy_args, pod_flags
from services.launcher.container_args import vllm_server
from services.launcher.deploy_overlays import DEV, OVERLAY_LIST, PRODUCTION, Overlay
from services.launcher.plan import Child, plan_cluster
from tests.deploy.render import Doc, containers, pod_templates

ADDRESS_OR_PATH = ("127.0.0.1", "0.0.0.0", "$(", "http://", "tcp://", "kvsched-")
# Flags naming the process itself: its id, its node (`conductor-0` under `kvsched up`, the
# pod's or the node's name in a cluster).
NAMES = ("--id", "--node", "--instance-id")


def test_the_committed_args_are_what_the_code_makes() -> None:
    stale = [o.name for o in OVERLAY_LIST if deploy_args.target(o).read_text()
             != deploy_args.render(o)]  # fmt: skip
    assert not stale, f"run `python -m services.launcher.deploy_args`: {stale} are stale"
    assert deploy_args.main(["--check"]) == 0


def test_check_reports_a_stale_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(deploy_args, "OVERLAYS", tmp_path)
    assert deploy_args.main(["--check"]) == 1
    assert "differs" in capsys.readouterr().err
    assert deploy_args.main([]) == 0 and deploy_args.main(["--check"]) == 0
    assert (tmp_path / "dev" / "args.yaml").read_text() == deploy_args.render(DEV)


def test_an_address_the_generator_cannot_place_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot place"):
        pod_flags.translate(["--peer", "127.0.0.1:5"], {}, lambda path: path)


def flags(argv: list[str] | tuple[str, ...]) -> list[tuple[str, str | None]]:
    return list(pod_flags.flag_pairs(argv))


def comparable(pairs: list[tuple[str, str | None]]) -> dict[str, str | None]:
    """Flag -> value, the value left out where it is an address or a path (those differ
    between loopback and a cluster by design)."""
    out: dict[str, str | None] = {}
    for flag, value in pairs:
        placed = value is not None and (
            value.startswith("/") or any(mark in value for mark in ADDRESS_OR_PATH)
        )
        tls_file = flag.endswith(("cert", "key", "-ca"))
        out[flag] = "<placed>" if placed or tls_file or flag in NAMES else value
    return out


def workload(docs: tuple[Doc, ...], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container(doc: Doc, name: str) -> Doc:
    (found,) = [c for c in containers(doc["spec"]["template"]) if c["name"] == name]
    return found


def plan_of(overlay: Overlay) -> dict[str, list[Child]]:
    plan = plan_cluster(overlay.options, Path("/run/x"), Path("/run/x/keys.json"), api_key="")
    return {stage: plan.stage(stage) for stage in ("conductor", "router", "messenger", "engine")}


def test_the_dev_overlay_has_the_shape_of_kvsched_up(rendered: dict[str, tuple[Doc, ...]]) -> None:
    docs, opts = rendered["overlays/dev"], DEV.options
    assert workload(docs, "StatefulSet", "kvsched-conductor")["spec"]["replicas"] == opts.conductors
    assert workload(docs, "Deployment", "kvsched-router")["spec"]["replicas"] == opts.routers
    assert workload(docs, "StatefulSet", "kvsched-etcd")["spec"]["replicas"] == 1
    messenger = workload(docs, "DaemonSet", "kvsched-messenger")
    names = Counter(c["name"].split("-")[0] for c in containers(messenger["spec"]["template"]))
    # One Messenger a node and its engines beside it, as `kvsched up` starts them.
    assert names == {"messenger": 1, "engine": opts.engines_per_node}
    # kvsched's own workloads: the Jaeger the overlay ships beside them aside.
    component = "app.kubernetes.io/component"
    kinds = Counter(d["kind"] for d in docs if d["metadata"]["labels"].get(component) != "jaeger")
    assert kinds["DaemonSet"] == 1 and kinds["Deployment"] == 1 and kinds["StatefulSet"] == 2


def test_the_dev_overlay_runs_kvsched_ups_flags(rendered: dict[str, tuple[Doc, ...]]) -> None:
    docs, plan = rendered["overlays/dev"], plan_of(DEV)
    cases = [
        ("StatefulSet", "kvsched-conductor", "conductor", plan["conductor"][0]),
        ("Deployment", "kvsched-router", "router", plan["router"][0]),
        ("DaemonSet", "kvsched-messenger", "messenger", plan["messenger"][0]),
    ]
    cases += [
        ("DaemonSet", "kvsched-messenger", f"engine-{e}", plan["engine"][e])
        for e in range(DEV.options.engines_per_node)
    ]
    for kind, name, container_name, child in cases:
        args = container(workload(docs, kind, name), container_name)["args"]
        assert args[0] == child.argv[2].removeprefix("services."), container_name
        ours, theirs = comparable(flags(args[1:])), comparable(flags(child.argv[3:]))
        # Where kvsched up lets a listener's address stand for the advertised one, a pod
        # names it; the pool's folder is a pod's, not /dev/shm: nothing else is added.
        added = set(ours) - set(theirs)
        assert added <= {"--advertise", "--kv-pool-dir"}, (container_name, added)
        assert {k: ours[k] for k in theirs} == theirs, container_name


def test_the_conductors_reach_etcd_as_kvsched_up_has_them(
    rendered: dict[str, tuple[Doc, ...]],
) -> None:
    conductor = container(
        workload(rendered["overlays/dev"], "StatefulSet", "kvsched-conductor"), "conductor"
    )
    env = {v["name"] for v in conductor["env"]}
    assert set(plan_of(DEV)["conductor"][0].env) <= env


def test_production_vllm_runs_the_command_line_of_kvsched_up(
    rendered: dict[str, tuple[Doc, ...]],
) -> None:
    docs = rendered["overlays/production"]
    vllm = container(workload(docs, "DaemonSet", "kvsched-vllm"), "vllm-0")
    argv = vllm_server(PRODUCTION, 0).argv()
    assert [*vllm["command"], *vllm["args"]] == argv
    for needed in ("--enable-prefix-caching", "--kv-events-config", "--kv-transfer-config"):
        assert needed in argv
    assert argv[argv.index("--block-size") + 1] == str(PRODUCTION.options.block_size)
    messenger = container(workload(docs, "DaemonSet", "kvsched-messenger"), "messenger")
    engine = messenger["args"][messenger["args"].index("--engine") + 1]
    assert engine.startswith("http://$(NODE_IP):8000,kind=vllm")


def test_production_vllm_has_the_flags_of_kvsched_up_engine_vllm(
    rendered: dict[str, tuple[Doc, ...]],
) -> None:
    """The same flags and values as the vLLM servers `kvsched up --engine vllm` starts for
    the same options, addresses and paths aside, and but for eager mode (CPU only)."""
    docs = rendered["overlays/production"]
    vllm = container(workload(docs, "DaemonSet", "kvsched-vllm"), "vllm-0")
    (child,) = plan_of(PRODUCTION)["engine"][:1]
    assert "--enforce-eager" in child.argv and "--enforce-eager" not in vllm["args"]
    theirs = vllm_flags([a for a in child.argv[3:] if a != "--enforce-eager"])
    assert vllm_flags(vllm["args"]) == theirs
    assert theirs["--kv-transfer-config"]["kv_connector"] == "KvschedConnector"


def vllm_flags(argv: list[str]) -> dict[str, Any]:
    """vLLM's flags, its JSON ones read, without where it listens, publishes and finds its
    model and pool (`--host`, `--port`, `--model`, the ZMQ endpoints, the pool's socket)."""
    out: dict[str, Any] = {}
    for flag, value in flags(argv):
        if flag in ("--host", "--port", "--model"):
            continue
        if value is not None and value.startswith("{"):
            config = json.loads(value)
            for key in ("endpoint", "replay_endpoint"):
                config.pop(key, None)
            config.get("kv_connector_extra_config", {}).pop("pool_socket", None)
            out[flag] = config
        else:
            out[flag] = value
    return out


def test_production_shapes(rendered: dict[str, tuple[Doc, ...]]) -> None:
    docs, opts = rendered["overlays/production"], PRODUCTION.options
    assert workload(docs, "StatefulSet", "kvsched-conductor")["spec"]["replicas"] == opts.conductors
    assert workload(docs, "StatefulSet", "kvsched-etcd")["spec"]["replicas"] == 3
    hpa = workload(docs, "HorizontalPodAutoscaler", "kvsched-router")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "kvsched-router"
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
               for d in docs if d["kind"] == "PodDisruptionBudget"}  # fmt: skip
    assert {"conductor", "etcd", "router"} <= budgets
    for _, template in pod_templates(docs):
        for c in containers(template):
            assert not any(a.startswith("--insecure") for a in c.get("args", [])), c["name"]
