"""Command-line flags whose defaults come from the environment, as every service takes them:
`--listen` of the Conductor also reads `KVSCHED_CONDUCTOR_LISTEN`, and so on."""

from __future__ import annotations

import argparse
import os

_TRUE = frozenset({"1", "true", "yes", "on"})


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
