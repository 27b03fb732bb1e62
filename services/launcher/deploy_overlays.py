"""The Kubernetes overlays (`deploy/overlays/<name>`) as clusters: each one's `kvsched up`
options, its etcd, and where its engines run (`Overlay`: `DEV`, `PRODUCTION`), and where
things are inside their pods: the mounted Secrets and model, the node's KV pool, the
Services' names and ports, and the downward API's variables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsched.core.models import DEFAULT_MODEL as REAL_MODEL
from services.launcher.cluster_options import ClusterOptions

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
