"""The `kvsched` command: the services, a local cluster, and the simulator (`replay`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from kvsched import __version__

# subcommand -> (module whose `main(argv) -> int` runs it, one-line help)
COMMANDS = {
    "replay": ("kvsched.sim.cli", "replay a trace through one or more policies (simulator)"),
    "knee": ("kvsched.sim.cli", "each policy's capacity knee by bisection, over seeds (simulator)"),
    "up": ("services.launcher.__main__", "run a whole local cluster on loopback"),
    "bench": ("services.loadgen.__main__", "replay a trace through live Routers"),
    "certs": ("services.launcher.certs", "mint mTLS certificates with a cluster's CA"),
    "vllm-flags": ("services.launcher.vllm_flags", "the flags a vLLM fleet needs behind kvsched"),
    "admin": ("services.launcher.admin", "an operator's calls: set the policy, drain Routers"),
    "health": (
        "services.common.serving.health_probe",
        "ask a gRPC server's health service (a probe)",
    ),
    "conductor": ("services.conductor.__main__", "run a Conductor (gRPC + HTTP admin)"),
    "router": ("services.router.__main__", "run a Router (OpenAI-compatible HTTP)"),
    "messenger": ("services.messenger.__main__", "run a node's Messenger"),
    "engine": ("services.engine.__main__", "run a simulated vLLM-compatible engine"),
}


SIMULATOR = {"replay", "knee"}


def usage() -> str:
    lines = [f"usage: kvsched [--version] {{{','.join(COMMANDS)}}} ...", ""]
    lines += [f"  {name:<10}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`kvsched COMMAND --help` lists a command's flags."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(usage(), end="")
        return 0
    if args[0] == "--version":
        print(f"kvsched {__version__}")
        return 0
    if args[0] not in COMMANDS:
        print(usage(), end="", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]][0])
    entry: Callable[[list[str]], int] = module.main
    # The simulator's own parser has the `replay` and `knee` subcommands; the services take
    # flags only.
    return entry(args if args[0] in SIMULATOR else args[1:])


if __name__ == "__main__":
    sys.exit(main())
