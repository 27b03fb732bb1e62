"""`python -m tools.fit_latency`: see the package docstring."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import tools.fit_latency
from tools.fit_latency.blis import BLIS_VLLM, blis_row
from tools.fit_latency.files import DEFAULT_PROFILES, DISTSERVE_CAPACITY, OUT_DIR
from tools.fit_latency.output import print_profile, profile_json, write_json
from tools.fit_latency.profiles import TP_70B, fit_a100, fit_h100, fit_h100_70b, load_inputs
from tools.fit_latency.provenance import (
    A100_METHOD,
    A100_SOURCES,
    H100_70B_METHOD,
    H100_70B_SOURCES,
    H100_METHOD,
    H100_SOURCES,
)
from tools.fit_latency.scaling import capacity_from_blis, distserve_models


def _description() -> str | None:
    doc = tools.fit_latency.__doc__
    return doc.splitlines()[0] if doc else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=_description())
    parser.add_argument("--profiles", type=Path, default=DEFAULT_PROFILES)
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output folder for the JSON")
    args = parser.parse_args(argv)

    inp = load_inputs(args.profiles)
    blis_h100 = blis_row(inp.blis_rows, "H100", BLIS_VLLM)
    if blis_h100.total_kv_blocks is None:
        raise LookupError("BLIS H100 row has no total_kv_blocks")
    arch, h100, a100 = inp.a100_ops.arch, inp.gpus["H100"], inp.gpus["A100-80"]
    cap_h100 = capacity_from_blis(blis_h100.total_kv_blocks, arch, h100, h100)
    cap_a100 = capacity_from_blis(blis_h100.total_kv_blocks, arch, h100, a100)
    models = ", ".join(distserve_models(inp.profiles / DISTSERVE_CAPACITY))
    print(f"DistServe capacity table covers {models}: no Llama rows, not used")

    hf = fit_h100(inp, cap_h100)
    af = fit_a100(inp, cap_a100)
    seventy = fit_h100_70b(inp, hf, cap_h100.mem_fraction)
    # (name, model, GPU, fit, sources, method, TP degree) of each shipped profile
    profiles = (
        ("llama-3.1-8b-h100", "meta-llama/Llama-3.1-8B-Instruct", "H100-80GB-SXM", hf,
         H100_SOURCES, H100_METHOD, 1),
        ("llama-3-8b-a100", "meta-llama/Meta-Llama-3-8B", "A100-80GB-SXM", af,
         A100_SOURCES, A100_METHOD, 1),
        ("llama-3.1-70b-h100-tp4", "meta-llama/Llama-3.1-70B-Instruct", "H100-80GB-SXM",
         seventy, H100_70B_SOURCES, H100_70B_METHOD, TP_70B),
    )  # fmt: skip
    docs = [
        profile_json(
            name=name,
            model=model,
            gpu=gpu,
            k=fit.constants,
            sources=sources,
            method=method,
            checks=fit.checks,
            tp=tp,
        )
        for name, model, gpu, fit, sources, method, tp in profiles
    ]
    for doc in docs:
        print_profile(doc)
        print(f"  wrote {write_json(doc, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
