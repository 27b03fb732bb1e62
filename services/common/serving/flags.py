"""Command-line flags whose defaults come from the environment, as every service takes them:
`--listen` of the Conductor also reads `KVSCHED_CONDUCTOR_LISTEN`, and so on; and the
settings every service fills the same way (its id, where its spans go)."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from functools import partial

_TRUE = frozenset({"1", "true", "yes", "on"})

# `flag(parser, name, default, help_text)`: `env_flag` with a service's prefix bound.
Flag = Callable[[argparse.ArgumentParser, str, object, str], None]


def parse_bool(text: str) -> bool:
    """`1`, `true`, `yes`, `on` (any case) are true; anything else is false."""
    return text.lower() in _TRUE


def env_flag(
    prefix: str, parser: argparse.ArgumentParser, name: str, default: object, help_text: str
) -> None:
    """Add `--name` to `parser`, defaulting to `$<prefix><NAME>` (dashes as underscores) or
    else `default`, and typed by `default` (a string when it is None). A bool flag works as
    a switch (`--no-auth`) or takes a value (`--persist-blocks false`)."""
    env = prefix + name.upper().replace("-", "_")
    raw = os.environ.get(env)
    text = f"{help_text} (env {env})"
    if isinstance(default, bool):
        value = default if raw is None else parse_bool(raw)
        parser.add_argument(
            f"--{name}", default=value, type=parse_bool, nargs="?", const=True, help=text
        )
        return
    kind = type(default) if default is not None else str
    parser.add_argument(f"--{name}", default=default if raw is None else raw, type=kind, help=text)


def env_flags(prefix: str) -> Flag:
    """`env_flag` for one service: `env_flags("KVSCHED_ROUTER_")(parser, "listen", ...)`."""
    return partial(env_flag, prefix)


def process_id() -> str:
    """`host-pid`: the id of a service process that no flag names."""
    return f"{socket.gethostname()}-{os.getpid()}"


def otlp_endpoint() -> str | None:
    """Where the process's spans are exported (`OTEL_EXPORTER_OTLP_ENDPOINT`), if anywhere."""
    return os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def pairs(text: str, flag: str, shape: str) -> tuple[tuple[str, str], ...]:
    """A flag's `KEY=VALUE,...` as pairs (`shape` names them in the error, e.g. "NAME=DIR");
    raises ValueError on a part without both."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = (x.strip() for x in part.partition("="))
        if not key or not value:
            raise ValueError(f"{flag} wants {shape}, got {part!r}")
        out.append((key, value))
    return tuple(out)
