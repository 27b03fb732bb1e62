"""`kvsched vllm-flags`: the flags an existing vLLM fleet's servers need to sit behind kvsched,
and the flags kvsched's own services then take to match them.

The vLLM flags are the ones `kvsched up --engine vllm` starts its engines with (`VllmServer`,
one source for both): prefix caching with the cluster's block size and hash algorithm, KV
events over ZMQ with a replay socket, prompt-token details, load tracking, tool calling, and
`--kv-transfer-config` loading kvsched's KV connector where the node has a KV pool. Printed as
a shell command line, then the environment, then the matching Messenger, Router and
Conductor flags:

    kvsched vllm-flags --model DIR [--served-model-name NAME] [--block-size 32]
        [--prefix-caching-hash-algo sha256] [--port 8000] [--kv-events-port 5557]
        [--kv-replay-port 5558] [--kv-pool-socket PATH] [--host 0.0.0.0]
        [--lora NAME=PATH ...] [--max-loras 2]

With `--lora`, the servers serve LoRA adapters loaded at run time (`--enable-lora`, and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`): the Routers take the adapters' names and paths (PATH as
the servers see it: it is part of each block's hash).
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from pathlib import Path

from services.dataplane import BlockHashes
from services.launcher.cluster_options import DEFAULT_BLOCK_SIZE
from services.launcher.vllm import VllmServer


def server_of(args: argparse.Namespace) -> VllmServer:
    """The vLLM server the flags describe."""
    return VllmServer(
        python=Path("python"),
        model_dir=args.model,
        served_name=args.served_model_name or args.model.name,
        port=args.port,
        kv_port=args.kv_events_port,
        replay_port=args.kv_replay_port,
        block_size=args.block_size,
        hash_algo=args.prefix_caching_hash_algo,
        pool_socket=args.kv_pool_socket,
        host=args.host,
        eager=False,  # (kvsched up's engines run eager only to start faster on a CPU)
        max_loras=args.max_loras if args.lora else 0,
    )


def render(server: VllmServer, loras: Sequence[str] = ()) -> str:
    """What the command prints for `server`, whose engines serve the adapters `loras`
    (NAME=PATH each)."""
    argv = ["vllm", "serve", str(server.model_dir), *server.argv()[5:]]  # (not --model DIR)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(server.env().items()))
    engine = f"http://HOST:{server.port},kind=vllm"
    if server.max_loras:
        engine += f",max_loras={server.max_loras}"
    adapters = f" --lora-modules {shlex.quote(','.join(loras))}" if loras else ""
    lines = [
        "# each vLLM server of the fleet (one per GPU or engine):",
        shlex.join(argv),
        "# its environment (CPU builds: KV memory in GiB; PYTHONPATH: kvsched's connector):",
        env,
        "# each node's Messenger, one --engine per vLLM server of the node:",
        f"kvsched messenger --engine {engine} --block-size {server.block_size} "
        f"--prefix-caching-hash-algo {server.hash_algo}"
        + (f" --kv-pool-socket {shlex.quote(server.pool_socket)}" if server.pool_socket else ""),
        "# the Routers and Conductors:",
        f"kvsched router --tokenizer {shlex.quote(str(server.model_dir))} "
        f"--model {shlex.quote(server.served_name)} --block-size {server.block_size} "
        f"--prefix-caching-hash-algo {server.hash_algo}{adapters}",
        f"kvsched conductor --block-size {server.block_size} "
        f"--prefix-caching-hash-algo {server.hash_algo}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvsched vllm-flags", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, required=True, help="the model directory vLLM serves")
    p.add_argument("--served-model-name", default="", help="default: the directory's name")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE["vllm"])
    p.add_argument("--prefix-caching-hash-algo", default=BlockHashes().algo)
    p.add_argument("--host", default="0.0.0.0", help="where the OpenAI server listens")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-events-port", type=int, default=5557)
    p.add_argument("--kv-replay-port", type=int, default=5558)
    p.add_argument("--kv-pool-socket", default="", help="the node's KV pool ('': no connector)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="a LoRA adapter the servers load (PATH as they see it)")  # fmt: skip
    p.add_argument("--max-loras", type=int, default=2, help="adapters held at once")
    args = p.parse_args(argv)
    if any("=" not in a for a in args.lora):
        p.error("--lora takes NAME=PATH")
    print(render(server_of(args), args.lora), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
