"""A fitted profile as the JSON `kvsched.core.latency` reads, written and printed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.fit_latency.numeric import sig
from tools.fit_latency.profiles import Constants, examples


def profile_json(
    *,
    name: str,
    model: str,
    gpu: str,
    k: Constants,
    sources: list[dict[str, str]],
    method: str,
    checks: dict[str, float],
    tp: int = 1,
    dtype: str = "bf16",
    request_overhead_s: float = 0.0,
    prefill_ctx_s: float = 0.0,
) -> dict[str, Any]:
    r = k.rounded()
    all_checks = {**checks, **examples(r, sig(prefill_ctx_s))}
    server = {  # the terms a profile fitted to a running server may add (0: left out)
        key: sig(value)
        for key, value in (
            ("request_overhead_s", request_overhead_s),
            ("prefill_ctx_s", prefill_ctx_s),
        )
        if value
    }
    return {
        "name": name,
        "model": model,
        "gpu": gpu,
        "tp": tp,
        "dtype": dtype or "the model's",
        "step_s": r.step_s,
        "prefill_token_s": r.prefill_token_s,
        "attn_pair_s": r.attn_pair_s,
        "decode_seq_s": r.decode_seq_s,
        "decode_ctx_s": r.decode_ctx_s,
        "kv_capacity_tokens": r.kv_capacity_tokens,
        **server,
        "sources": sources,
        "method": method,
        "checks": {key: v if v.is_integer() else sig(v) for key, v in all_checks.items()},
    }


def write_json(doc: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{doc['name']}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def print_profile(doc: dict[str, Any]) -> None:
    print(f"\n== {doc['name']}  ({doc['model']}, {doc['gpu']}, TP{doc['tp']}, {doc['dtype']})")
    units = {
        "step_s": (1e3, "ms"),
        "prefill_token_s": (1e6, "us/token"),
        "attn_pair_s": (1e9, "ns/pair"),
        "decode_seq_s": (1e6, "us/seq"),
        "decode_ctx_s": (1e9, "ns/ctx token"),
    }
    for key, (mult, unit) in units.items():
        print(f"  {key:<18} {doc[key] * mult:>10.4g} {unit}")
    print(f"  {'kv_capacity_tokens':<18} {doc['kv_capacity_tokens']:>10,d}")
    if "prefill_ctx_s" in doc:
        print(f"  {'prefill_ctx_s':<18} {doc['prefill_ctx_s'] * 1e9:>10.4g} ns/ctx token")
    if "request_overhead_s" in doc:
        print(f"  {'request_overhead_s':<18} {doc['request_overhead_s'] * 1e3:>10.4g} ms")
    print("  checks:")
    for key, value in doc["checks"].items():
        print(f"    {key:<52} {value:.6g}")
