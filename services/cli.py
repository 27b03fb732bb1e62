"""The `kvsched` command: services (`conductor`; more to come) and the simulator (`replay`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: kvsched {replay,conductor} ...

  replay      replay a trace through one or more policies (simulator)
  conductor   run a Conductor (gRPC + HTTP admin; flags: kvsched conductor --help)
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "conductor":
        from services.conductor.__main__ import main as conductor  # noqa: PLC0415

        return conductor(args[1:])
    if args and args[0] in {"-h", "--help"}:
        print(USAGE, end="")
        return 0
    from kvsched.sim.cli import main as simulator  # noqa: PLC0415

    return simulator(args)


if __name__ == "__main__":
    sys.exit(main())
