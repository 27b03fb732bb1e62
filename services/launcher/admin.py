"""`kvsched admin`: an operator's calls to a running cluster, made with the admin identity
(`kvsched up` writes its files to the endpoints file's `admin` entry):

    kvsched admin --endpoints FILE policy [SPEC]     # show, or set, the placement policy
    kvsched admin --endpoints FILE drain on|off      # every Router stops (resumes) taking work

or, for a cluster started by hand, `--conductor ADDR[,ADDR] --router-grpc ADDR[,ADDR] --ca
CA --cert CERT --key KEY` (no `--ca`: plaintext, for an `--insecure` cluster)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from clients.python import ConductorClient, ConductorError, tls_credentials
from kvsched.api.router.v1 import router_service_pb2 as rpb
from kvsched.api.router.v1 import router_service_pb2_grpc as rpb_grpc

DESCRIPTION = "Set the policy or drain the Routers of a running cluster, as its operator."


@dataclass(frozen=True)
class Target:
    """Where the cluster's Conductors and Routers' admin servers are, and the credentials."""

    conductors: tuple[str, ...]
    routers: tuple[str, ...]
    credentials: grpc.ChannelCredentials | None


def _target(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Target:
    ca, cert, key = args.ca, args.cert, args.key
    conductors = [c for c in args.conductor.split(",") if c]
    routers = [r for r in args.router_grpc.split(",") if r]
    if args.endpoints is not None:
        ep = json.loads(args.endpoints.read_text())
        conductors = conductors or [c["url"] for c in ep.get("conductors", [])]
        routers = routers or [r["grpc_url"] for r in ep.get("routers", [])]
        admin = ep.get("admin") or {}
        ca, cert, key = ca or admin.get("ca"), cert or admin.get("cert"), key or admin.get("key")
    if not conductors:
        parser.error("give --endpoints FILE or --conductor ADDR")
    if (cert is None) != (key is None) or (cert is not None and ca is None):
        parser.error("--cert and --key go together, and need --ca")
    credentials = tls_credentials(ca, cert, key) if ca else None
    return Target(tuple(conductors), tuple(routers), credentials)


async def _policy(target: Target, spec: str | None) -> str:
    async with ConductorClient(target.conductors, credentials=target.credentials) as client:
        if spec is None:
            return (await client.get_policy()).spec
        answer = await client.set_policy(spec)
        return f"{answer.previous_spec} -> {answer.spec}"


async def _drain(target: Target, draining: bool) -> str:
    lines = []
    for url in target.routers:
        if target.credentials is None:
            channel = grpc.aio.insecure_channel(url)
        else:
            channel = grpc.aio.secure_channel(url, target.credentials)
        async with channel:
            stub = rpb_grpc.RouterServiceStub(channel)
            await stub.SetDraining(rpb.SetDrainingRequest(draining=draining), timeout=5.0)
            lines.append(f"{url}: {'draining' if draining else 'serving'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvsched admin", description=DESCRIPTION)
    p.add_argument("--endpoints", type=Path, help="endpoints file written by `kvsched up`")
    p.add_argument("--conductor", default="", help="Conductor gRPC address(es), comma-separated")
    p.add_argument("--router-grpc", default="", help="Routers' gRPC admin address(es)")
    p.add_argument("--ca", help="CA (PEM) of the cluster's certificates")
    p.add_argument("--cert", help="the operator's certificate (PEM), an admin/... identity")
    p.add_argument("--key", help="its private key (PEM)")
    actions = p.add_subparsers(dest="action", required=True)
    policy = actions.add_parser("policy", help="show the policy, or set it to SPEC")
    policy.add_argument("spec", nargs="?", help="e.g. cache_aware or ear:t_hot_tokens=20000")
    drain = actions.add_parser("drain", help="make every Router refuse (off: take) new work")
    drain.add_argument("state", choices=("on", "off"))
    args = p.parse_args(argv)
    try:
        target = _target(args, p)
        if args.action == "policy":
            print(asyncio.run(_policy(target, args.spec)))
        else:
            if not target.routers:
                p.error("give --endpoints FILE or --router-grpc ADDR")
            print(asyncio.run(_drain(target, args.state == "on")))
    except (OSError, ValueError) as exc:
        print(f"kvsched admin: {exc}", file=sys.stderr)
        return 2
    except ConductorError as exc:
        print(f"kvsched admin: {exc.code.name}: {exc}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as exc:
        print(f"kvsched admin: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
