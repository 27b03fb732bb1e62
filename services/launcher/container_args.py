"""Each overlay's containers' command lines, made from what `kvsched up` runs:
`plan_cluster` decides every process's flags, exactly as for `kvsched up`, and this module
only puts each address and file where it is in a pod (`pod_flags`: the Services' DNS
names, the mounted Secrets, the node's KV pool). The vLLM pods' command line is
`VllmServer.argv()`, the one `kvsched up --engine vllm` runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.launcher.deploy_overlays import (
    ADMIN_TOKEN,
    API_KEYS,
    CONDUCTOR,
    CONDUCTOR_GRPC,
    CONDUCTOR_HTTP,
    ENGINE_HTTP,
    KV_EVENTS,
    MESSENGER_GRPC,
    MESSENGER_HTTP,
    MODEL_DIR,
    NODE,
    POD,
    POOL_DIR,
    POOL_SOCKET,
    ROUTER_GRPC,
    ROUTER_HTTP,
    VLLM_HTTP,
    Overlay,
    conductor_addresses,
    etcd_endpoints,
)
from services.launcher.plan import plan_cluster
from services.launcher.pod_flags import (
    Place,
    constant,
    image_args,
    one_command_line,
    service_flags,
    tls_file,
    translate,
)
from services.launcher.vllm import VllmServer


def container_args(overlay: Overlay) -> dict[str, Any]:
    """Per workload and container: `args` (and `env`, `command`) as the pods run them."""
    opts = overlay.options
    plan = plan_cluster(opts, Path("/run/kvsched"), Path(API_KEYS), api_key="")
    conductors = conductor_addresses(opts)
    model_dir = {"tokenizer": constant(MODEL_DIR)}
    out: dict[str, Any] = {}

    argvs = []
    for child in plan.stage("conductor"):
        places: dict[str, Place] = {
            "id": constant(POD),
            "listen": constant(f"0.0.0.0:{CONDUCTOR_GRPC}"),
            "http-listen": constant(f"0.0.0.0:{CONDUCTOR_HTTP}"),
            "admin-token-file": constant(ADMIN_TOKEN),
        }
        advertise = ["--advertise", f"{POD}.{CONDUCTOR}:{CONDUCTOR_GRPC}"]
        flags = translate(service_flags(child), places, tls_file(POD), advertise)
        argvs.append(image_args(child, flags))
    tls = tls_file(POD)
    env = {"KVSCHED_ETCD_ENDPOINTS": etcd_endpoints(overlay.etcd_members)}
    env |= {k: tls(v) for k, v in plan.stage("conductor")[0].env.items() if k.endswith("_FILE")}
    out["conductor"] = {"args": one_command_line(argvs, "Conductors"), "env": env}

    argvs = []
    for child in plan.stage("router"):
        places = {
            "listen": constant(f"0.0.0.0:{ROUTER_HTTP}"),
            "grpc-listen": constant(f"0.0.0.0:{ROUTER_GRPC}"),
            "conductor": constant(conductors),
            "api-keys": constant(API_KEYS),
            **model_dir,
        }
        # The Routers of a Deployment share one identity: their role decides what they may call.
        flags = translate(service_flags(child), places, tls_file("router"))
        argvs.append(image_args(child, flags))
    out["router"] = {"args": one_command_line(argvs, "Routers")}

    engines = plan.stage("engine")
    per_node = opts.engines_per_node
    argvs = []
    engine_port = ENGINE_HTTP if opts.engine == "sim" else VLLM_HTTP
    for child in plan.stage("messenger"):
        order = iter(range(per_node))  # its --engine values, in its engines' order

        def engine(value: str, order: Iterator[int] = order) -> str:
            return _engine_target(value, overlay.engine_host, engine_port + next(order))

        places = {
            "listen": constant(f"0.0.0.0:{MESSENGER_GRPC}"),
            "http-listen": constant(f"0.0.0.0:{MESSENGER_HTTP}"),
            "node": constant(NODE),
            "conductor": constant(conductors),
            "kv-pool-socket": constant(POOL_SOCKET),
            "engine": engine,
        }
        pool = ["--kv-pool-dir", POOL_DIR] if opts.kv_pool_bytes else []
        advertise = ["--advertise", overlay.messenger_address, *pool]
        flags = translate(service_flags(child), places, tls_file(NODE), advertise)
        argvs.append(image_args(child, flags))
    out["messenger"] = {"args": one_command_line(argvs, "Messengers")}

    if opts.engine == "sim":
        for e in range(per_node):
            argvs = []
            for child in engines[e::per_node]:
                places = {
                    "listen": constant(f"0.0.0.0:{ENGINE_HTTP + e}"),
                    "instance-id": constant(f"{NODE}-e{e}"),
                    "kv-events": constant(f"tcp://127.0.0.1:{KV_EVENTS + 2 * e}"),
                    "kv-replay": constant(f"tcp://127.0.0.1:{KV_EVENTS + 2 * e + 1}"),
                    "kv-pool-socket": constant(POOL_SOCKET),
                    **model_dir,
                }
                flags = translate(service_flags(child), places, tls_file(NODE))
                argvs.append(image_args(child, flags))
            out[f"engine-{e}"] = {"args": one_command_line(argvs, f"engines {e}")}
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
