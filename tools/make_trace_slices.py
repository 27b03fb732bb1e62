"""Regenerate the shipped trace slices in data/traces/ from the full shared traces.

    python tools/make_trace_slices.py [SHARED_TRACES_DIR] [--out OUT_DIR]

SHARED_TRACES_DIR defaults to ../shared/traces next to the repository root; OUT_DIR to
data/traces/ in the repository. The slices are byte-identical leading lines of the upstream
files (the WEKA one recompressed with xz); the README lists sizes, hashes and ideal APCs
computed with kvsched.sim.traces. Running it twice gives identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(REPO))

from kvsched.sim.traces import Trace, ideal_apc, read_azure, read_mooncake, read_weka  # noqa: E402

DEFAULT_SHARED = REPO.parent / "shared" / "traces"
DEFAULT_OUT = REPO / "data" / "traces"

MOONCAKE_ROWS = 3000
AZURE_ROWS = 3000
WEKA_TRACES = 24
WEKA_MAX_BYTES = 400_000
XZ_PRESET = 9 | lzma.PRESET_EXTREME

MOONCAKE_SRC = "conversation_trace.jsonl"
WEKA_SRC = "weka_cc_agentic/weka_cc_agentic_calls.jsonl.xz"
WEKA_META_SRC = "weka_cc_agentic/weka_cc_agentic_trace_meta.json"
AZURE_SRC = "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
APACHE_SRC = "weka_cc_agentic/LICENSE-Apache-2.0.txt"
CC_BY_SRC = "azure_llm_2023/LICENSE-CC-BY-4.0.txt"

MOONCAKE_OUT = "mooncake_conversation_head.jsonl"
WEKA_OUT = "weka_cc_agentic_sample.jsonl.xz"
WEKA_META_OUT = "weka_cc_agentic_sample_trace_meta.json"
AZURE_OUT = "azure_conv_head.csv"
APACHE_OUT = "LICENSE-Apache-2.0.txt"
CC_BY_OUT = "LICENSE-CC-BY-4.0.txt"


@dataclass(frozen=True)
class Slice:
    """One written slice and what the README says about it."""

    file: str
    source: str
    licence: str
    how: str
    rows: int
    apc_global: float | None = None
    apc_session: float | None = None


def head_lines(f: IO[bytes], n: int) -> bytes:
    """The first `n` lines of a binary stream, terminators kept (byte-identical)."""
    out: list[bytes] = []
    for line in f:
        if len(out) == n:
            break
        out.append(line)
    if len(out) < n:
        raise ValueError(f"only {len(out)} lines, wanted {n}")
    return b"".join(out)


def weka_lines(path: Path) -> Iterator[tuple[str, bytes]]:
    """(trace id, raw line) for each line of the WEKA calls file, streaming."""
    with lzma.open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                session = json.loads(line)["session_id"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: no session_id") from None
            yield str(session).split("/", 1)[0], line


def first_weka_traces(path: Path, n: int) -> tuple[bytes, list[str]]:
    """All lines of the first `n` traces in file order, and those trace ids."""
    traces: list[str] = []
    out: list[bytes] = []
    for trace, line in weka_lines(path):
        if not traces or trace != traces[-1]:
            if len(traces) == n:
                break
            traces.append(trace)
        out.append(line)
    return b"".join(out), traces


def write_weka(shared: Path, out: Path) -> list[str]:
    """Write the xz sample with as many of the first WEKA_TRACES traces as fit the byte cap."""
    for n in range(WEKA_TRACES, 0, -1):
        raw, traces = first_weka_traces(shared / WEKA_SRC, n)
        packed = lzma.compress(raw, format=lzma.FORMAT_XZ, preset=XZ_PRESET)
        if len(packed) <= WEKA_MAX_BYTES:
            (out / WEKA_OUT).write_bytes(packed)
            return traces
    raise ValueError("not even one WEKA trace fits the byte cap")


def write_weka_meta(shared: Path, out: Path, traces: list[str]) -> None:
    """The trace-meta entries of the sampled traces (for `weka_shared_prefix`)."""
    meta = json.loads((shared / WEKA_META_SRC).read_text(encoding="utf-8"))
    keep = [m for m in meta if m["trace_id"] in set(traces)]
    (out / WEKA_META_OUT).write_text(json.dumps(keep) + "\n", encoding="utf-8")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def describe(out: Path, weka_traces: list[str]) -> list[Slice]:
    """Read the written slices back with kvsched.sim.traces and compute their ceilings."""
    mc = read_mooncake(out / MOONCAKE_OUT)
    wk = read_weka(out / WEKA_OUT)
    az = read_azure(out / AZURE_OUT)

    def apcs(t: Trace) -> dict[str, float]:
        return {
            "apc_global": ideal_apc(t, scope="global"),
            "apc_session": ideal_apc(t, scope="session"),
        }

    return [
        Slice(
            MOONCAKE_OUT,
            f"github.com/kvcache-ai/Mooncake `FAST25-release/traces/{MOONCAKE_SRC}` (3b5a5941)",
            "Apache-2.0 (`LICENSE-Apache-2.0.txt`)",
            f"first {MOONCAKE_ROWS:,} lines, byte-identical",
            len(mc.calls),
            **apcs(mc),
        ),
        Slice(
            WEKA_OUT,
            "github.com/callanjfox/kv-cache-tester `traces/`, as reshaped in "
            "`weka_cc_agentic_calls.jsonl.xz` (hash ids as deltas)",
            "Apache-2.0 (`LICENSE-Apache-2.0.txt`)",
            f"all calls of the first {len(weka_traces)} traces in file order "
            f"({weka_traces[0]} … {weka_traces[-1]}), byte-identical lines, xz preset 9e",
            len(wk.calls),
            **apcs(wk),
        ),
        Slice(
            WEKA_META_OUT,
            "`weka_cc_agentic_trace_meta.json` of the same set",
            "Apache-2.0 (`LICENSE-Apache-2.0.txt`)",
            "the entries of the sampled traces, re-serialised as one JSON list",
            len(weka_traces),
        ),
        Slice(
            AZURE_OUT,
            "github.com/Azure/AzurePublicDataset `data/AzureLLMInferenceTrace_conv.csv` "
            "(b469a113); cite Patel et al., Splitwise, ISCA 2024",
            "CC-BY-4.0 (`LICENSE-CC-BY-4.0.txt`)",
            f"header + first {AZURE_ROWS:,} rows, byte-identical (CRLF kept)",
            len(az.calls),
            **apcs(az),
        ),
    ]


def _apc(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


def readme(out: Path, slices: list[Slice]) -> str:
    """The README text: per file source, licence, slicing, bytes, sha256, rows, ideal APC."""
    lines = [
        "# Trace slices shipped with kvsched",
        "",
        "Small leading slices of public traces, so tests and the demo run without the full",
        "files. Regenerate them with `python tools/make_trace_slices.py` (reads",
        "`../shared/traces/`); do not edit them by hand.",
        "",
        "| file | source | licence | slice | bytes | sha256 | rows |",
        "| --- | --- | --- | --- | ---: | --- | ---: |",
    ]
    for s in slices:
        path = out / s.file
        lines.append(
            f"| `{s.file}` | {s.source} | {s.licence} | {s.how} | "
            f"{path.stat().st_size:,} | `{sha256(path)}` | {s.rows:,} |"
        )
    lines += [
        "",
        "Ideal APC (`kvsched.sim.traces.ideal_apc`): one unbounded cache fed in trace order,",
        "H = min(matched leading full blocks × block tokens, input − 1), token-weighted;",
        '"session" counts only earlier calls of the same session.',
        "",
        "| file | block tokens | ideal APC, global | ideal APC, session |",
        "| --- | ---: | ---: | ---: |",
    ]
    blocks = {MOONCAKE_OUT: 512, WEKA_OUT: 64, AZURE_OUT: 64}
    for s in slices:
        if s.apc_global is not None:
            lines.append(
                f"| `{s.file}` | {blocks[s.file]} | {_apc(s.apc_global)} | {_apc(s.apc_session)} |"
            )
    lines += [
        "",
        "Notes:",
        "",
        "- Mooncake: full 512-token blocks only (the partial last block is dropped), sessions",
        "  rebuilt by prefix chaining (`kvsched.sim.traces.mooncake.SESSION_RULE`). Upstream's",
        "  README figures (0.3736 for the whole conversation file) also count the partial block.",
        "- WEKA: a sub-agent's `t_in_trace` restarts at 0; the reader puts it on the trace clock",
        "  after the main-agent call that spawned it (see `read_weka`).",
        "- Azure: no reuse information; every request gets fresh block ids.",
        "",
    ]
    return "\n".join(lines)


def make(shared: Path, out: Path) -> list[Slice]:
    """Write every slice, the licences and the README into `out`."""
    if not shared.is_dir():
        raise SystemExit(f"no shared traces at {shared}")
    out.mkdir(parents=True, exist_ok=True)
    with (shared / MOONCAKE_SRC).open("rb") as f:
        (out / MOONCAKE_OUT).write_bytes(head_lines(f, MOONCAKE_ROWS))
    with (shared / AZURE_SRC).open("rb") as f:
        (out / AZURE_OUT).write_bytes(head_lines(f, AZURE_ROWS + 1))
    traces = write_weka(shared, out)
    write_weka_meta(shared, out, traces)
    shutil.copyfile(shared / APACHE_SRC, out / APACHE_OUT)
    shutil.copyfile(shared / CC_BY_SRC, out / CC_BY_OUT)
    slices = describe(out, traces)
    (out / "README.md").write_text(readme(out, slices), encoding="utf-8")
    return slices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("shared", nargs="?", type=Path, default=DEFAULT_SHARED)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for s in make(args.shared, args.out):
        apc = (
            "" if s.apc_global is None else f", ideal APC {s.apc_global:.4f} / {s.apc_session:.4f}"
        )
        print(f"{s.file}: {s.rows} rows{apc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
