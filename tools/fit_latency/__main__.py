"""`python -m tools.fit_latency`: see the package docstring."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path

import aiohttp

import tools.fit_latency
from kvsched.core.cluster import ClusterConfig
from services.common.inference_api.openai_api import PromptTokenizer
from tools.fit_latency.blis import BLIS_VLLM, blis_row
from tools.fit_latency.engine_fit import fit_engine, predicted_s
from tools.fit_latency.engine_probes import LONG_OUTPUT, SHORT_OUTPUT, EngineProbes, probe_plan
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
    parser.add_argument(
        "--out",
        type=Path,
        help="output folder (default kvsched/data/latency; out/latency with --engine)",
    )
    live = parser.add_argument_group("a running engine instead of the profiles")
    live.add_argument("--engine", metavar="URL", help="time this idle vLLM OpenAI server")
    live.add_argument("--name", default="vllm-cpu", help="the profile's name (its file name)")
    live.add_argument("--device", default="CPU", help="what it runs on, for the profile")
    live.add_argument(
        "--chunk-tokens",
        type=int,
        default=ClusterConfig(n_instances=1).chunk_tokens,
        help="its prompt tokens per pass (vLLM's --max-num-batched-tokens)",
    )
    live.add_argument("--repeats", type=int, default=3, help="runs per probe (median)")
    live.add_argument("--seed", type=int, default=0, help="of the probes' random prompts")
    args = parser.parse_args(argv)
    if args.engine:
        return asyncio.run(_fit_engine(args, args.out or Path("out/latency")))

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
        print(f"  wrote {write_json(doc, args.out or OUT_DIR)}")
    return 0


async def _fit_engine(args: argparse.Namespace, out: Path) -> int:
    """Probe the engine at `args.engine`, fit, print and write the profile."""
    # Idle connections are dropped before uvicorn's 5 s keep-alive ends: a connection the
    # server closes as a probe reuses it fails that probe (ServerDisconnectedError).
    connector = aiohttp.TCPConnector(keepalive_timeout=2)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        probes = EngineProbes(
            http,
            args.engine,
            vocab=PromptTokenizer().vocab_size,
            repeats=args.repeats,
            seed=args.seed,
        )
        shape = await probes.shape()
        plan = probe_plan(shape)
        prefill = await probes.prefill(plan.prefill)
        decode = await probes.decode(plan.batches, plan.contexts, SHORT_OUTPUT, LONG_OUTPUT)
        cached = await probes.cached(plan.cached)
    chunk = args.chunk_tokens
    fit = fit_engine(
        prefill,
        decode,
        chunk_tokens=chunk,
        kv_capacity_tokens=shape.kv_capacity_tokens,
        cached=cached,
    )
    method = (
        f"Timed on {args.engine} (idle, {args.repeats} runs per probe, median): one request "
        f"alone of {', '.join(map(str, plan.prefill))} fresh prompt tokens and one output token "
        "and of new tokens on a cached prefix ("
        + ", ".join(f"{c}+{n}" for c, n in plan.cached)
        + f") (prefill), and {', '.join(map(str, plan.batches))} requests at once of "
        f"{' and '.join(map(str, plan.contexts))} prompt tokens, with {SHORT_OUTPUT} and "
        f"{LONG_OUTPUT} output tokens (decode: the difference per token is one pass); "
        f"{chunk} prompt tokens per pass; capacity from vllm:cache_config_info "
        "(python -m tools.fit_latency --engine URL; tools/fit_latency/engine_fit.py)"
    )
    checks = {
        "prefill_fit_max_rel_err": fit.prefill_max_rel_err,
        "decode_fit_max_rel_err": fit.decode_max_rel_err,
        **{f"prefill_{p.tokens}_measured_s": p.latency_s for p in prefill},
        **{f"decode_b{d.batch}_c{d.context}_measured_s": d.step_s for d in decode},
    }
    for probe in cached:  # the fit against an agent turn's shape
        name = f"cached_{probe.cached}_new_{probe.new}"
        checks[f"{name}_measured_s"] = probe.latency_s
        checks[f"{name}_fitted_s"] = predicted_s(fit, probe.new, probe.cached, chunk)
    source = {
        "file": "measured",
        "upstream": f"{shape.model} served by vLLM at {args.engine}",
        "license": "-",
        "used_for": "every constant and the KV capacity",
    }
    doc = profile_json(
        name=args.name,
        model=shape.model,
        gpu=args.device,
        k=fit.constants,
        sources=[source],
        method=method,
        checks=checks,
        dtype="",
        request_overhead_s=fit.overhead_s,
        prefill_ctx_s=fit.prefill_ctx_s,
    )
    print_profile(doc)
    print(f"  wrote {write_json(doc, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
