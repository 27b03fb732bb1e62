"""`kvsched up`: start a local cluster, print its endpoints, stop it all on Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from services.common.inference_api.openai_api import DEFAULT_MODEL
from services.common.security.files import write_private
from services.common.serving.flags import pairs
from services.dataplane import BlockHashes
from services.launcher.cluster_options import DEFAULT_BLOCK_SIZE, ENGINES, ClusterOptions
from services.launcher.plan import ClusterPlan, plan_cluster
from services.launcher.supervisor import StartError, Supervisor
from services.router.api_keys import new_key

DEMO_TENANT = "demo"


def build_parser() -> argparse.ArgumentParser:
    d = ClusterOptions()
    p = argparse.ArgumentParser(prog="kvsched up", description=__doc__)
    p.add_argument("--conductors", type=int, default=d.conductors, help="Conductors (1 leads)")
    p.add_argument("--routers", type=int, default=d.routers)
    p.add_argument("--nodes", type=int, default=d.nodes, help="nodes, one Messenger each")
    p.add_argument("--engines-per-node", type=int, default=d.engines_per_node)
    p.add_argument("--policy", default=d.policy, help="placement policy spec, e.g. cache_aware")
    p.add_argument("--block-size", type=int, default=0, help="tokens per KV block (default: "
                   + ", ".join(f"{n} for --engine {e}" for e, n in DEFAULT_BLOCK_SIZE.items())
                   + ")")  # fmt: skip
    p.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="engine wall time per simulated second (0.1: ten times faster than the GPU)",
    )
    p.add_argument("--instance-ttl", type=int, default=d.instance_ttl_s, help="lease TTL (s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--api-keys", type=Path, help="Routers' API key file (default: a demo key)")
    p.add_argument(
        "--engine-flag",
        action="append",
        default=[],
        help="extra flag for every engine, e.g. --engine-flag=--capacity-blocks=4096",
    )
    p.add_argument(
        "--messenger-flag",
        action="append",
        default=[],
        help="extra flag for every Messenger, e.g. --messenger-flag=--transfer-rate=1e8",
    )
    p.add_argument(
        "--model-config",
        default=d.model_config,
        help="architecture the engines model (sizes their real KV bytes and transfers)",
    )
    p.add_argument(
        "--latency-profile",
        default=d.latency_profile,
        metavar="NAME|PATH",
        help="step-time profile the Conductors price placements with (and the simulated "
        "engines run): a shipped name or a .json, e.g. fitted to the engines by "
        "`python -m tools.fit_latency --engine URL` (default: the Conductors' default)",
    )
    p.add_argument(
        "--transfer-backend",
        choices=("mooncake", "tcp"),
        default=d.transfer_backend,
        help="how Messengers move KV bytes",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=d.engine,
        help="simulated engines, or stock vLLM servers (needs --model and scripts/setup --vllm)",
    )
    p.add_argument("--model", type=Path, action="append", default=[],
                   help="model directory: vLLM serves it, Routers use its tokenizer and chat "
                   "template (e.g. out/models/tiny-llama); again for more models, "
                   "--engines-per-node engines of each on every node")  # fmt: skip
    p.add_argument("--served-model-name", help="the first model's name in the API (default: "
                   "its directory's name, or the simulated engines' model); the others are "
                   "named by their directories")  # fmt: skip
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="a LoRA adapter of the first model (a peft directory), requested as "
                   "model NAME; loaded at run time where its requests are placed")  # fmt: skip
    p.add_argument("--embedding-model", action="append", default=[], metavar="NAME=DIR",
                   help="a model served for /v1/embeddings as NAME: one vLLM pooling engine "
                   "of it on every node (--engine vllm)")  # fmt: skip
    p.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapters each engine holds at once (vLLM's --max-loras)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=0, help="context length (0: model's)")
    p.add_argument("--vllm-python", type=Path, default=d.vllm_python, help="vLLM's Python")
    p.add_argument("--tool-call-parser", default=d.tool_call_parser,
                   help="vLLM's tool-call parser ('': no tool calling)")  # fmt: skip
    p.add_argument("--dtype", default=d.dtype, help="vLLM's --dtype ('': the model's)")
    p.add_argument("--chat-template", type=Path, help="a chat template file in place of the "
                   "model's, for engines and Routers alike (vLLM's --chat-template)")  # fmt: skip
    p.add_argument("--kv-pool-bytes", type=int, default=d.kv_pool_bytes,
                   help="each node's KV pool for vLLM engines, bytes (0: none)")  # fmt: skip
    p.add_argument("--prefix-caching-hash-algo", default=d.block_hashes.algo,
                   help="the engines' block hash algorithm (vLLM's flag)")  # fmt: skip
    p.add_argument("--prefix-hash-seed", help="the engines' PYTHONHASHSEED (default: unset)")
    p.add_argument("--run-dir", type=Path, help="logs and etcd data (default: a temp dir)")
    p.add_argument("--endpoints-file", type=Path, help="write the endpoints JSON here")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="no TLS, certificates or admin token: plaintext gRPC and etcd, every RPC open",
    )
    p.add_argument("--quiet", action="store_true", help="print only errors")
    return p


def _profile(name: str) -> str:
    """A latency profile's name, or its file made absolute (every process reads it)."""
    return str(Path(name).resolve()) if name.endswith(".json") else name


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    """The cluster `kvsched up`'s parsed flags ask for; raises `ValueError`."""
    return ClusterOptions(
        conductors=args.conductors,
        routers=args.routers,
        nodes=args.nodes,
        engines_per_node=args.engines_per_node,
        policy=args.policy,
        block_size=args.block_size or DEFAULT_BLOCK_SIZE[args.engine],
        time_scale=args.time_scale,
        instance_ttl_s=args.instance_ttl,
        seed=args.seed,
        api_keys=args.api_keys,
        engine_flags=tuple(args.engine_flag),
        messenger_flags=tuple(args.messenger_flag),
        model_config=args.model_config,
        latency_profile=_profile(args.latency_profile),
        transfer_backend=args.transfer_backend,
        engine=args.engine,
        model_dir=args.model[0] if args.model else None,
        model=args.served_model_name or (args.model[0].name if args.model else DEFAULT_MODEL),
        more_models=tuple((path.name, path) for path in args.model[1:]),
        lora_modules=tuple(map(_lora, args.lora)),
        embedding_models=tuple(map(_named_dir, args.embedding_model)),
        max_loras=args.max_loras,
        vllm_python=args.vllm_python,
        max_model_len=args.max_model_len,
        tool_call_parser=args.tool_call_parser,
        dtype=args.dtype,
        chat_template=args.chat_template,
        kv_pool_bytes=args.kv_pool_bytes,
        block_hashes=BlockHashes(args.prefix_caching_hash_algo, args.prefix_hash_seed),
        insecure=args.insecure,
    )


def _named_dir(value: str, flag: str = "--embedding-model") -> tuple[str, Path]:
    """A flag's `NAME=DIR` as a served name and a directory."""
    named = pairs(value, flag, "NAME=DIR")
    if len(named) != 1:
        raise ValueError(f"{flag} takes one NAME=DIR, not {value!r}")
    return named[0][0], Path(named[0][1])


def _lora(value: str) -> tuple[str, Path]:
    """`--lora NAME=DIR` with the directory made absolute: engines load the adapter from that
    path and its blocks' hashes name it, so the Routers must be given the same string."""
    name, directory = _named_dir(value, "--lora")
    path = directory.resolve()
    if not (path / "adapter_config.json").is_file():
        raise ValueError(f"--lora {name}: {directory} has no adapter_config.json")
    return name, path


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = cluster_options(args)
    except ValueError as exc:
        print(f"kvsched up: {exc}", file=sys.stderr)
        return 2
    keep = args.run_dir is not None
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="kvsched-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return asyncio.run(_up(opts, run_dir, args.endpoints_file, args.quiet))
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


async def _up(opts: ClusterOptions, run_dir: Path, endpoints_file: Path | None, quiet: bool) -> int:
    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    if opts.api_keys is not None:
        keys_path, api_key = opts.api_keys, ""
    else:
        keys_path, api_key = run_dir / "api-keys.json", demo_keys(run_dir / "api-keys.json")
    plan = plan_cluster(opts, run_dir, keys_path, api_key)
    sup = Supervisor(plan, run_dir / "logs", say=lambda t: print(t, file=sys.stderr, flush=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        starting = asyncio.ensure_future(sup.start())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return 130
        stopping.cancel()
        starting.result()
        endpoints = plan.endpoints(sup.pids())
        if endpoints_file is not None:
            write_private(endpoints_file, json.dumps(endpoints, indent=2) + "\n")
        say(_describe(plan, run_dir, endpoints_file))
        while not stop.is_set():
            sup.check_exits()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await stop.wait()
        say("stopping ...")
        return 0
    except StartError as exc:
        print(f"kvsched up: {exc}", file=sys.stderr)
        return 1
    finally:
        sup.stop()
        if endpoints_file is not None:
            with contextlib.suppress(FileNotFoundError):
                endpoints_file.unlink()


def demo_keys(path: Path) -> str:
    """A keys file with one demo tenant (a fresh key and salt); returns the key."""
    return new_key(path, DEMO_TENANT)


def _describe(plan: ClusterPlan, run_dir: Path, file: Path | None) -> str:
    lines = [f"kvsched up: {len(plan.children)} processes, policy {plan.options.policy}"]
    for child in plan.children:
        url = child.endpoint.get("url", "")
        extra = child.endpoint.get("http_url", "")
        lines.append(f"  {child.name:<22} {url:<28} {extra}")
    lines.append(f"  logs: {run_dir / 'logs'}")
    creds = plan.credentials
    if creds is None:
        lines.append("  --insecure: plaintext gRPC and etcd, no identities, admin HTTP open")
    else:
        admin = creds.admin
        lines.append(f"  mutual TLS; CA {admin.ca}")
        lines.append(f"  admin certificate {admin.cert}, key {admin.key}")
        lines.append(f"  admin HTTP token file {creds.admin_token_file}")
    if file is not None:
        lines.append(f"  endpoints (and the demo API key): {file}")
        if creds is not None:
            lines.append(f"  as the operator: kvsched admin --endpoints {file} policy [SPEC]")
    elif plan.api_key:
        lines.append("  the demo API key is in the endpoints file: pass --endpoints-file PATH")
    lines.append("Ctrl-C stops everything.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
