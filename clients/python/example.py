"""Registers an instance, places one request on it, lists the instances, then cleans up.

python -m clients.python.example --conductor 127.0.0.1:50051 [--conductor host:port ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from google.protobuf import text_format
from google.protobuf.message import Message

from clients.python import ConductorClient, ConductorError, Rejected, pack_hashes
from kvsched.api.common.v1 import common_pb2
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb


def _show(message: Message) -> str:
    return text_format.MessageToString(message, as_one_line=True)


async def run(addresses: list[str], keep: bool) -> int:
    async with ConductorClient(addresses) as client:
        print("leader:", await client.leader())
        instance_id = f"example/engine-{os.getpid()}"
        spec = pb.InstanceSpec(
            instance_id=instance_id,
            url="http://127.0.0.1:8000",
            node="example",
            role=common_pb2.ROLE_BOTH,
            model="example-model",
        )
        registered = await client.register_instance(spec, lease_ttl_s=30)
        print("registered:", _show(registered.instance.spec), "slot", registered.instance.slot)
        try:
            # 40 tokens = two full blocks of 16 (the Conductor's default block size) + 8 more;
            # their hashes packed (8 bytes each), which the Conductor reads fastest.
            hashes = pack_hashes([0x1234, 0xFFFFFFFFFFFFFFC5])
            request = pb.ScheduleRequest(
                prompt_tokens=40, output_tokens=16, packed_block_hashes=hashes
            )
            try:
                decision = await client.schedule(request)
            except Rejected as err:
                print(f"rejected: {err.message} (retry after {err.retry_after_s}s)")
            else:
                print(f"request {request.request_id} -> {decision.instance_id}", _show(decision))
                finished = await client.finish(
                    pb.FinishRequest(
                        request_id=request.request_id,
                        instance_id=decision.instance_id,
                        decode_instance_id=decision.decode_instance_id,
                        prompt_tokens=40,
                        output_tokens=16,
                        packed_block_hashes=hashes,
                        ok=True,
                    )
                )
                print(f"finished: {len(finished.transfers)} transfers to start")
            for status in await client.list_instances():
                print(
                    f"instance {status.spec.instance_id} slot={status.slot} "
                    f"role={common_pb2.Role.Name(status.spec.role)} in_flight={status.in_flight} "
                    f"gpu_blocks={status.gpu_blocks}"
                )
        finally:
            if not keep:
                await client.deregister(instance_id)
                print("deregistered", instance_id)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--conductor",
        action="append",
        help="Conductor gRPC address host:port (repeat, or comma-separate, for several); "
        "default $KVSCHED_CONDUCTOR or 127.0.0.1:50051",
    )
    parser.add_argument("--keep", action="store_true", help="leave the instance registered")
    args = parser.parse_args(argv)
    given = args.conductor or [os.environ.get("KVSCHED_CONDUCTOR", "127.0.0.1:50051")]
    addresses = [a.strip() for value in given for a in value.split(",") if a.strip()]
    try:
        return asyncio.run(run(addresses, args.keep))
    except ConductorError as err:
        print(f"example failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
