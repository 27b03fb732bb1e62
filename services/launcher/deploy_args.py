"""The command lines of the Kubernetes overlays' containers, made from what `kvsched up` runs,
so that a cluster on Kubernetes is started with the flags the tests prove on loopback:

    python -m services.launcher.deploy_args [--check]

writes `deploy/overlays/<overlay>/args.yaml` (kustomize patches setting each container's
`args`, the Conductor's etcd environment and the vLLM pods' command) for every overlay, or
with `--check` only says which differ from what it would write (exit 1).

Each overlay is a `ClusterOptions`: `plan_cluster` decides every process's flags, exactly as
for `kvsched up`, and this module only puts each address and file where it is in a pod (the
Services' DNS names, the mounted Secrets, the node's KV pool); a flag with an address or a
path that it does not know how to place is an error, so a new one cannot slip through
pointing at loopback. The vLLM pods' command line is `VllmServer.argv()`, the one
`kvsched up --engine vllm` runs. Pure but for the writing: nothing is started."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsched.core.models import DEFAULT_MODEL as REAL_MODEL
from services.launcher.plan import Child, ClusterOptions, plan_cluster
from services.launcher.vllm import VllmServer

REPO = Path(__file__).resolve().parent.parent.parent
OVERLAYS = REPO / "deploy" / "overlays"

# Where things are inside the pods (deploy/README.md has the Secrets' layout).
TLS_DIR = "/etc/kvsched/tls"  # the role's Secret: ca.crt, <name>.crt, <name>.key
ADMIN_TOKEN = "/etc/kvsched/admin/token"
API_KEYS = "/etc/kvsched/api-keys/api-keys.json"
MODEL_DIR = "/models/model"  # the served model (weights, tokenizer, chat template)
POOL_DIR = "/run/kvsched/pool"  # the node's KV pool: its memory file and socket
POOL_SOCKET = f"{POOL_DIR}/pool.sock"
CONDUCTOR, ETCD = "kvsched-conductor", "kvsched-etcd"  # StatefulSets and their Services
# Ports: those the Services and probes name (deploy/base), and the engines' (in the
# Messenger's pod in dev; vLLM on the GPU node's host network in production).
CONDUCTOR_GRPC, CONDUCTOR_HTTP = 50051, 8081
ROUTER_HTTP, ROUTER_GRPC = 8000, 50061
MESSENGER_GRPC, MESSENGER_HTTP = 50071, 8082
ENGINE_HTTP, VLLM_HTTP, KV_EVENTS = 8100, 8000, 5557
# Expanded by the kubelet from each container's env (the downward API).
POD, POD_IP, NODE, NODE_IP = "$(POD_NAME)", "$(POD_IP)", "$(NODE_NAME)", "$(NODE_IP)"
MESSENGER = "kvsched-messenger"  # the DaemonSet, and the headless Service naming its pods
NAMESPACE, CLUSTER_DOMAIN = "kvsched", "cluster.local"  # the overlays', and Kubernetes' default


@dataclass(frozen=True)
class Overlay:
    """One overlay's cluster: its options as `kvsched up` takes them, its etcd, and where
    the engines run: in the Messenger's pod (simulated engines), or in pods of their own
    beside it on the host network (vLLM on GPU nodes, reached at the node's address)."""

    name: str
    options: ClusterOptions
    etcd_members: int
    vllm_eager: bool = False  # vLLM's CUDA graphs on a GPU; eager only on a CPU

    @property
    def host_network(self) -> bool:
        return self.options.engine == "vllm"

    @property
    def messenger_address(self) -> str:
        """Where the Conductor and the other Messengers reach a Messenger: its pod's full
        name, which its certificate holds (`*.kvsched-messenger....`) and its own /etc/hosts
        resolves at once (its transfer backend binds it at start, before DNS may have it),
        or its node's address (host network)."""
        fqdn = f"{POD}.{MESSENGER}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
        return f"{NODE_IP if self.host_network else fqdn}:{MESSENGER_GRPC}"

    @property
    def engine_host(self) -> str:
        return NODE_IP if self.host_network else POD_IP


# `kvsched up`'s defaults: one Conductor, two Routers, two simulated engines a node.
DEV = Overlay("dev", ClusterOptions(), etcd_members=1)
PRODUCTION = Overlay(
    "production",
    ClusterOptions(
        conductors=3,
        routers=3,
        nodes=2,
        engines_per_node=1,
        engine="vllm",
        model_dir=Path(MODEL_DIR),
        model=REAL_MODEL,
        model_config=REAL_MODEL,
        block_size=32,  # what `kvsched up --engine vllm` takes (the CPU build's multiples of 32)
        leader_ttl_s=3,
        instance_ttl_s=10,
        kv_pool_bytes=16 << 30,
        transfer_backend="mooncake",
        messenger_flags=("--mooncake-protocol", "rdma"),
    ),
    etcd_members=3,
)
OVERLAY_LIST = (DEV, PRODUCTION)


def conductor_addresses(opts: ClusterOptions) -> str:
    """Every Conductor by its StatefulSet pod's DNS name (the headless Service's)."""
    return ",".join(f"{CONDUCTOR}-{i}.{CONDUCTOR}:{CONDUCTOR_GRPC}" for i in range(opts.conductors))


def etcd_endpoints(members: int) -> str:
    return ",".join(f"https://{ETCD}-{i}.{ETCD}:2379" for i in range(members))


def _tls_file(name: str) -> Callable[[str], str]:
    """A TLS file of `kvsched up`'s run folder, as the role's Secret mounts it."""

    def place(path: str) -> str:
        if path.endswith("/ca.pem"):
            return f"{TLS_DIR}/ca.crt"
        if path.endswith(".pem"):
            return f"{TLS_DIR}/{name}.crt"
        if path.endswith(".key"):
            return f"{TLS_DIR}/{name}.key"
        raise ValueError(f"not a TLS file of a run folder: {path}")

    return place


Place = Callable[[str], str | None]  # a flag's value under `kvsched up` -> in the pod


def _const(value: str) -> Place:
    """Whatever the value was, `value`."""
    return lambda _: value


def _flag_pairs(argv: Sequence[str]) -> Iterator[tuple[str, str | None]]:
    """`--flag value` pairs of a service's argv (a flag followed by a flag has no value)."""
    i = 0
    while i < len(argv):
        flag = argv[i]
        if not flag.startswith("--"):
            raise ValueError(f"expected a flag, got {flag!r} in {' '.join(argv)}")
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        yield flag, argv[i + 1] if has_value else None
        i += 2 if has_value else 1


def _translate(
    argv: Sequence[str],
    places: dict[str, Place],
    tls: Callable[[str], str],
    extra: Sequence[str] = (),
) -> list[str]:
    """`argv` with each flag in `places` given its in-cluster value (None: dropped), each TLS
    file placed by `tls`, and `extra` appended; raises ValueError for any other flag whose
    value is an address or a path."""
    out: list[str] = []
    for flag, value in _flag_pairs(argv):
        if value is None:
            out.append(flag)
            continue
        name = flag.removeprefix("--")
        if name in places:
            placed = places[name](value)
            if placed is not None:
                out += [flag, placed]
        elif name.endswith(("cert", "key", "ca")):
            out += [flag, tls(value)]
        elif "127.0.0.1" in value or value.startswith("/"):
            raise ValueError(f"{flag} {value}: an address or path deploy_args cannot place")
        else:
            out += [flag, value]
    return out + list(extra)


def _service_argv(child: Child) -> list[str]:
    """The flags of a `python -m services.<name> ...` command line."""
    _python, dash_m, module, *flags = child.argv
    if dash_m != "-m" or not module.startswith("services."):
        raise ValueError(f"{child.name} is not a kvsched service: {child.argv[:3]}")
    return flags


def _command(child: Child, flags: list[str]) -> list[str]:
    """The image's `kvsched` arguments: the service's subcommand, then its flags."""
    return [child.argv[2].removeprefix("services."), *flags]


def _same(values: Sequence[list[str]], what: str) -> list[str]:
    """The one command line every pod of a kind runs (they differ only by expansions)."""
    first = values[0]
    if any(v != first for v in values):
        raise ValueError(f"the {what} would run different command lines: {values}")
    return first


def container_args(overlay: Overlay) -> dict[str, Any]:
    """Per workload and container: `args` (and `env`, `command`) as the pods run them."""
    opts = overlay.options
    plan = plan_cluster(opts, Path("/run/kvsched"), Path(API_KEYS), api_key="")
    conductors = conductor_addresses(opts)
    model_dir = {"tokenizer": _const(MODEL_DIR)}
    out: dict[str, Any] = {}

    argvs = []
    for child in plan.stage("conductor"):
        places: dict[str, Place] = {
            "id": _const(POD),
            "listen": _const(f"0.0.0.0:{CONDUCTOR_GRPC}"),
            "http-listen": _const(f"0.0.0.0:{CONDUCTOR_HTTP}"),
            "admin-token-file": _const(ADMIN_TOKEN),
        }
        advertise = ["--advertise", f"{POD}.{CONDUCTOR}:{CONDUCTOR_GRPC}"]
        flags = _translate(_service_argv(child), places, _tls_file(POD), advertise)
        argvs.append(_command(child, flags))
    tls = _tls_file(POD)
    env = {"KVSCHED_ETCD_ENDPOINTS": etcd_endpoints(overlay.etcd_members)}
    env |= {k: tls(v) for k, v in plan.stage("conductor")[0].env.items() if k.endswith("_FILE")}
    out["conductor"] = {"args": _same(argvs, "Conductors"), "env": env}

    argvs = []
    for child in plan.stage("router"):
        places = {
            "listen": _const(f"0.0.0.0:{ROUTER_HTTP}"),
            "grpc-listen": _const(f"0.0.0.0:{ROUTER_GRPC}"),
            "conductor": _const(conductors),
            "api-keys": _const(API_KEYS),
            **model_dir,
        }
        # The Routers of a Deployment share one identity: their role decides what they may call.
        flags = _translate(_service_argv(child), places, _tls_file("router"))
        argvs.append(_command(child, flags))
    out["router"] = {"args": _same(argvs, "Routers")}

    engines = plan.stage("engine")
    per_node = opts.engines_per_node
    argvs = []
    engine_port = ENGINE_HTTP if opts.engine == "sim" else VLLM_HTTP
    for child in plan.stage("messenger"):
        order = iter(range(per_node))  # its --engine values, in its engines' order

        def engine(value: str, order: Iterator[int] = order) -> str:
            return _engine_target(value, overlay.engine_host, engine_port + next(order))

        places = {
            "listen": _const(f"0.0.0.0:{MESSENGER_GRPC}"),
            "http-listen": _const(f"0.0.0.0:{MESSENGER_HTTP}"),
            "node": _const(NODE),
            "conductor": _const(conductors),
            "kv-pool-socket": _const(POOL_SOCKET),
            "engine": engine,
        }
        pool = ["--kv-pool-dir", POOL_DIR] if opts.kv_pool_bytes else []
        advertise = ["--advertise", overlay.messenger_address, *pool]
        flags = _translate(_service_argv(child), places, _tls_file(NODE), advertise)
        argvs.append(_command(child, flags))
    out["messenger"] = {"args": _same(argvs, "Messengers")}

    if opts.engine == "sim":
        for e in range(per_node):
            argvs = []
            for child in engines[e::per_node]:
                places = {
                    "listen": _const(f"0.0.0.0:{ENGINE_HTTP + e}"),
                    "instance-id": _const(f"{NODE}-e{e}"),
                    "kv-events": _const(f"tcp://127.0.0.1:{KV_EVENTS + 2 * e}"),
                    "kv-replay": _const(f"tcp://127.0.0.1:{KV_EVENTS + 2 * e + 1}"),
                    "kv-pool-socket": _const(POOL_SOCKET),
                    **model_dir,
                }
                flags = _translate(_service_argv(child), places, _tls_file(NODE))
                argvs.append(_command(child, flags))
            out[f"engine-{e}"] = {"args": _same(argvs, f"engines {e}")}
    else:
        for e in range(per_node):
            server = vllm_server(overlay, e)
            argv = server.argv()
            # The CPU build's settings are not a GPU server's; the connector is installed in
            # the image (deploy/Dockerfile.vllm), not imported from a checkout.
            env = {
                k: v
                for k, v in server.env().items()
                if not k.startswith("VLLM_CPU_") and k != "PYTHONPATH"
            }
            out[f"vllm-{e}"] = {"command": argv[:3], "args": argv[3:], "env": env}
    return out


def _engine_target(value: str, host: str, port: int) -> str:
    """A Messenger's `--engine URL,options` for the engine at `host:port`, its id by the
    node's name (`node-0-e1` is `$(NODE_NAME)-e1`)."""
    _, *options = value.split(",")
    placed = []
    for option in options:
        key, _, text = option.partition("=")
        if key == "id":
            text = f"{NODE}-e{text.rsplit('-e', 1)[1]}"
        placed.append(f"{key}={text}")
    return ",".join([f"http://{host}:{port}", *placed])


def vllm_server(overlay: Overlay, index: int) -> VllmServer:
    """vLLM engine `index` of a node, as `plan_cluster` makes it for `kvsched up --engine
    vllm`, listening where the pod is reached, its KV events on the node's loopback."""
    opts = overlay.options
    return VllmServer(
        python=Path("python3"),
        model_dir=Path(MODEL_DIR),
        served_name=opts.model,
        port=VLLM_HTTP + index,
        kv_port=KV_EVENTS + 2 * index,
        replay_port=KV_EVENTS + 2 * index + 1,
        block_size=opts.block_size,
        hash_algo=opts.block_hashes.algo,
        hash_seed=opts.block_hashes.seed,
        max_model_len=opts.max_model_len,
        eager=overlay.vllm_eager,
        tool_call_parser=opts.tool_call_parser,
        dtype=opts.dtype,
        pool_socket=POOL_SOCKET if opts.kv_pool_bytes else "",
        host="0.0.0.0",
    )


WORKLOADS = {  # container -> (kind, name) of the workload running it
    "conductor": ("StatefulSet", "kvsched-conductor"),
    "router": ("Deployment", "kvsched-router"),
    "messenger": ("DaemonSet", MESSENGER),
    "engine": ("DaemonSet", MESSENGER),  # simulated engines run in the Messenger's pod
    "vllm": ("DaemonSet", "kvsched-vllm"),
}


def patches(overlay: Overlay) -> list[dict[str, Any]]:
    """Strategic-merge patches, one per workload, setting its containers' command lines."""
    by_workload: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for container, spec in container_args(overlay).items():
        kind, name = WORKLOADS[container.split("-")[0]]
        entry: dict[str, Any] = {"name": container}
        if "command" in spec:
            entry["command"] = spec["command"]
        entry["args"] = spec["args"]
        if "env" in spec:
            entry["env"] = _env(spec["env"])
        by_workload.setdefault((kind, name), []).append(entry)
    api = {"StatefulSet": "apps/v1", "Deployment": "apps/v1", "DaemonSet": "apps/v1"}
    return [
        {
            "apiVersion": api[kind],
            "kind": kind,
            "metadata": {"name": name},
            "spec": {"template": {"spec": {"containers": containers}}},
        }
        for (kind, name), containers in by_workload.items()
    ]


# The downward API's fields behind the variables the command lines use.
FIELDS = {
    "POD_NAME": "metadata.name",
    "POD_IP": "status.podIP",
    "NODE_NAME": "spec.nodeName",
    "NODE_IP": "status.hostIP",
}


def _env(values: dict[str, str]) -> list[dict[str, Any]]:
    """A container's `env`: first the downward-API variables the values name (the kubelet
    expands `$(VAR)` only from variables defined before), then the values."""
    used = [name for name in FIELDS if any(f"$({name})" in v for v in values.values())]
    fields = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": FIELDS[name]}}} for name in used
    ]
    return fields + [{"name": k, "value": v} for k, v in values.items()]


HEADER = (
    "# Generated by `python -m services.launcher.deploy_args` from what `kvsched up` runs\n"
    "# (services/launcher/plan.py, vllm.py): do not edit; tests/deploy checks it is current.\n"
)


def render(overlay: Overlay) -> str:
    """The overlay's `args.yaml`."""
    docs = [_yaml(doc, 0) for doc in patches(overlay)]
    return HEADER + "---\n".join(docs)


def _yaml(value: Any, indent: int) -> str:
    """Block YAML with every string JSON-quoted (so no value is ever read as another type)."""
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                lines.append(f"{pad}{key}:\n{_yaml(item, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}\n")
        return "".join(lines)
    lines = []
    for item in value:
        if isinstance(item, dict | list) and item:
            body = _yaml(item, indent + 2)
            lines.append(f"{pad}- {body[indent + 2 :]}")
        else:
            lines.append(f"{pad}- {_scalar(item)}\n")
    return "".join(lines)


def _scalar(value: Any) -> str:
    return json.dumps(value)


def target(overlay: Overlay) -> Path:
    return OVERLAYS / overlay.name / "args.yaml"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.launcher.deploy_args",
        description="Write each overlay's args.yaml from what `kvsched up` runs.",
    )
    p.add_argument("--check", action="store_true", help="only report files that differ (exit 1)")
    args = p.parse_args(argv)
    stale = []
    for overlay in OVERLAY_LIST:
        path, text = target(overlay), render(overlay)
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    for path in stale:
        verb = "differs from what kvsched up runs" if args.check else "written"
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        print(f"{shown}: {verb}", file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
