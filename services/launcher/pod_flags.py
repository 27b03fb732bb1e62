"""Placing a `kvsched up` process's flags into a pod: each flag with an address or a path
given the value it has in the cluster (`Place`), its TLS files those of the role's mounted
Secret, and an error for any such flag nothing places, so that none slips through pointing
at loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from services.launcher.deploy_overlays import TLS_DIR
from services.launcher.plan import Child


def tls_file(name: str) -> Callable[[str], str]:
    """A TLS file of `kvsched up`'s run folder, as the role's Secret mounts it."""

    def place(path: str) -> str:
        if path.endswith("/ca.pem"):
            return f"{TLS_DIR}/ca.crt"
        if path.endswith(".pem"):
            return f"{TLS_DIR}/{name}.crt"
        if path.endswith(".key"):
            return f"{TLS_DIR}/{name}.key"
        raise ValueError(f"not a TLS file of a run folder: {path}")

    return place


Place = Callable[[str], str | None]  # a flag's value under `kvsched up` -> in the pod


def constant(value: str) -> Place:
    """Whatever the value was, `value`."""
    return lambda _: value


def flag_pairs(argv: Sequence[str]) -> Iterator[tuple[str, str | None]]:
    """`--flag value` pairs of a service's argv (a flag followed by a flag has no value)."""
    i = 0
    while i < len(argv):
        flag = argv[i]
        if not flag.startswith("--"):
            raise ValueError(f"expected a flag, got {flag!r} in {' '.join(argv)}")
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        yield flag, argv[i + 1] if has_value else None
        i += 2 if has_value else 1


def translate(
    argv: Sequence[str],
    places: dict[str, Place],
    tls: Callable[[str], str],
    extra: Sequence[str] = (),
) -> list[str]:
    """`argv` with each flag in `places` given its in-cluster value (None: dropped), each TLS
    file placed by `tls`, and `extra` appended; raises ValueError for any other flag whose
    value is an address or a path."""
    out: list[str] = []
    for flag, value in flag_pairs(argv):
        if value is None:
            out.append(flag)
            continue
        name = flag.removeprefix("--")
        if name in places:
            placed = places[name](value)
            if placed is not None:
                out += [flag, placed]
        elif name.endswith(("cert", "key", "ca")):
            out += [flag, tls(value)]
        elif "127.0.0.1" in value or value.startswith("/"):
            raise ValueError(f"{flag} {value}: an address or path deploy_args cannot place")
        else:
            out += [flag, value]
    return out + list(extra)


def service_flags(child: Child) -> list[str]:
    """The flags of a `python -m services.<name> ...` command line."""
    _python, dash_m, module, *flags = child.argv
    if dash_m != "-m" or not module.startswith("services."):
        raise ValueError(f"{child.name} is not a kvsched service: {child.argv[:3]}")
    return flags


def image_args(child: Child, flags: list[str]) -> list[str]:
    """The image's `kvsched` arguments: the service's subcommand, then its flags."""
    return [child.argv[2].removeprefix("services."), *flags]


def one_command_line(values: Sequence[list[str]], what: str) -> list[str]:
    """The one command line every pod of a kind runs (they differ only by expansions)."""
    first = values[0]
    if any(v != first for v in values):
        raise ValueError(f"the {what} would run different command lines: {values}")
    return first
