"""`kvsched replay`'s hardware options: each is recorded in report.json's config and changes
what it should; bad ones are one-line errors; with none the config is what it was before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvsched.core.memory import GIB
from kvsched.data_files import data_path
from kvsched.sim.cli import main
from tests.conftest import SLICES

TRACE = str(SLICES / "mooncake_conversation_head.jsonl")
SLICE = ("--trace", TRACE, "--instances", "4", "--max-requests", "300", "--no-figures")
LINKS = {
    "node": {"bandwidth_gb_per_s": 150.0, "setup_ms": 5.0},
    "rack": {"bandwidth_gb_per_s": 25.0, "setup_ms": 5.0},
    "spine": {"bandwidth_gb_per_s": 12.5, "setup_ms": 6.0},
    "cluster": {"bandwidth_gb_per_s": 3.0, "setup_ms": 10.0},
}
# report.json's config for `SLICE` with `cache_aware`, as written before the hardware options.
DEFAULT_CONFIG = {
    "policies": ["cache_aware"],
    "instances": 4,
    "seed": 0,
    "load": 1.0,
    "mode": "open",
    "warmup_fraction": 0.05,
    "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "kv_bytes_per_token": 131072,
    "max_model_len": 131072,
    "gpu": "H100-80GB-SXM",
    "latency_profile": {
        "name": "llama-3.1-8b-h100",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "gpu": "H100-80GB-SXM",
        "step_s": 0.005753,
        "prefill_token_s": 2.006e-05,
        "attn_pair_s": 1.14e-09,
        "decode_seq_s": 5.999e-06,
        "decode_ctx_s": 4.547e-08,
        "kv_capacity_tokens": 467280,
        "request_overhead_s": 0.0,
        "prefill_ctx_s": 0.0,
    },
    "kv_capacity_tokens": 467280,
    "block_size": 512,
    "chunk_tokens": 8192,
    "max_running": 256,
    "speculative_ttl_s": 5.0,
    "topology": {
        "instances_per_node": 4,
        "nodes_per_rack": 2,
        "racks_per_spine": 4,
        "links": LINKS,
    },
}


def replay(tmp: Path, policies: str, *args: str) -> dict[str, Any]:
    out = tmp / "-".join(a.strip("-").replace("/", "_") for a in (policies, *args))[:120]
    assert (
        main(["replay", *SLICE, "--policies", policies, *args, "--out", str(out), "--quiet"]) == 0
    )
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def test_no_options_keep_the_config_and_the_gpu_memory_rule_agrees(tmp_path: Path) -> None:
    default = replay(tmp_path, "cache_aware")
    hardware = default["config"].pop("hardware")
    tier = default["config"].pop("tier")  # the node KV pool's options (tests/sim/test_tiers.py)
    assert default["config"] == DEFAULT_CONFIG
    assert (tier["dram"], tier["ssd"]) == ("0", "0")
    assert hardware["kv_capacity"] == {"from": "latency_profile", "tokens": 467280}
    assert (hardware["model_config"], hardware["latency_profile"]) == (
        "meta-llama/Llama-3.1-8B-Instruct",
        "llama-3.1-8b-h100",
    )
    assert hardware["model"]["params"] == 8_030_261_248 and hardware["links_given"] == []
    # An 80 GiB GPU at vLLM's default share reproduces the profile's capacity, so the run too.
    h100 = replay(tmp_path, "cache_aware", "--gpu-memory", "80")
    assert h100["config"]["hardware"]["kv_capacity"]["from"] == "gpu_memory"
    assert h100["config"]["kv_capacity_tokens"] == 467280
    assert h100["policies"] == default["policies"]


def test_a_smaller_kv_capacity_lowers_the_hit_rate(tmp_path: Path) -> None:
    default = replay(tmp_path, "cache_aware")["policies"]["cache_aware"]
    small = replay(tmp_path, "cache_aware", "--kv-capacity", "131072")
    assert small["config"]["kv_capacity_tokens"] == 131072
    assert small["config"]["hardware"]["kv_capacity"] == {"from": "kv_capacity", "tokens": 131072}
    assert small["policies"]["cache_aware"]["apc"] < default["apc"]


def test_gpu_memory_sizes_the_kv_cache_as_vllm_does(tmp_path: Path) -> None:
    report = replay(
        tmp_path,
        "cache_aware",
        *("--gpu-memory", "80", "--gpu-memory-utilization", "0.7", "--activation-memory", "2"),
    )
    weights = 8_030_261_248 * 2
    tokens = int(80 * 0.7 * GIB - weights - 2 * GIB) // 131072 // 16 * 16
    config = report["config"]
    assert config["kv_capacity_tokens"] == tokens
    assert config["hardware"]["kv_capacity"] == {
        "from": "gpu_memory",
        "gpu_memory_gib": 80.0,
        "gpu_memory_utilization": 0.7,
        "activation_memory_gib": 2.0,
        "weights_gib": weights / GIB,
        "tokens": tokens,
    }


def test_a_small_gpu_takes_a_shorter_context(tmp_path: Path) -> None:
    # 24 GiB × 0.9 less 15 GiB of weights hold 54,400 tokens: under the 8B's 128K context
    # (refused above) but a 32K one fits, and longer prompts are refused as oversize.
    small = replay(tmp_path, "cache_aware", "--gpu-memory", "24", "--max-model-len", "32768")
    config, trace = small["config"], small["trace"]
    assert (config["kv_capacity_tokens"], config["max_model_len"]) == (54400, 32768)
    assert config["hardware"]["model"]["max_model_len"] == 131072
    assert trace["oversize_calls"] > 0
    assert small["policies"]["cache_aware"]["rejected"] >= trace["oversize_calls"]


def test_the_model_config_sizes_kv_and_weights(tmp_path: Path) -> None:
    qwen = replay(tmp_path, "cache_aware", "--model-config", "Qwen/Qwen3-32B", "--gpu-memory", "80")
    config = qwen["config"]
    assert (config["model"], config["kv_bytes_per_token"]) == ("Qwen/Qwen3-32B", 262144)
    assert config["max_model_len"] == 40960
    # 32.8B parameters of weights leave a fraction of the 8B's KV cache, at twice the bytes.
    assert 40960 <= config["kv_capacity_tokens"] < 467280 // 8
    mine = tmp_path / "my-model.json"
    mine.write_text(
        json.dumps(
            {"name": "my-8b-fp8-kv", "layers": 32, "kv_heads": 8, "head_dim": 128,
             "dtype_bytes": 1, "params": 8_030_261_248}
        )
    )  # fmt: skip
    fp8 = replay(tmp_path, "cache_aware", "--model-config", str(mine), "--gpu-memory", "80")
    config = fp8["config"]
    assert config["hardware"]["model_config"] == str(mine)
    assert (config["model"], config["kv_bytes_per_token"]) == ("my-8b-fp8-kv", 65536)
    assert config["kv_capacity_tokens"] == pytest.approx(2 * 467280, abs=16)


def test_the_latency_profile_sets_step_times(tmp_path: Path) -> None:
    h100 = replay(tmp_path, "cache_aware")["policies"]["cache_aware"]
    a100 = replay(tmp_path, "cache_aware", "--latency-profile", "llama-3-8b-a100")
    assert a100["config"]["gpu"] == "A100-80GB-SXM"
    assert a100["config"]["latency_profile"]["name"] == "llama-3-8b-a100"
    assert a100["policies"]["cache_aware"]["ttft_p50"] > 2 * h100["ttft_p50"]
    shipped = json.loads(data_path("latency", "llama-3.1-8b-h100.json").read_text())
    mine = tmp_path / "my-gpu.json"
    mine.write_text(json.dumps({**shipped, "name": "my-gpu", "gpu": "MY-GPU"}))
    same = replay(tmp_path, "cache_aware", "--latency-profile", str(mine))
    assert same["config"]["gpu"] == "MY-GPU"
    assert same["config"]["hardware"]["latency_profile"] == str(mine)
    assert same["policies"]["cache_aware"] == h100


def test_link_speeds_set_transfer_times(tmp_path: Path) -> None:
    # mooncake hands every request's KV from its prefill to its decode instance: on one node
    # (4 instances) over the node link, so a slow link delays decoding.
    fast = replay(tmp_path, "mooncake")
    slow = replay(tmp_path, "mooncake", "--link", "node=1", "--link", "rack=50,1")
    links = slow["config"]["topology"]["links"]
    assert links["node"] == {"bandwidth_gb_per_s": 1.0, "setup_ms": 5.0}
    assert links["rack"] == {"bandwidth_gb_per_s": 50.0, "setup_ms": 1.0}
    assert links["spine"] == LINKS["spine"] and links["cluster"] == LINKS["cluster"]
    assert slow["config"]["hardware"]["links_given"] == ["node", "rack"]
    assert fast["config"]["topology"]["links"] == LINKS
    assert slow["policies"]["mooncake"]["tpot_p90"] > 10 * fast["policies"]["mooncake"]["tpot_p90"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--latency-profile", "b200"],
            "known profiles: llama-3-8b-a100, llama-3.1-70b-h100-tp4, llama-3.1-8b-h100",
        ),
        (["--latency-profile", "absent.json"], "known profiles: llama-3-8b-a100"),
        (["--model-config", "gpt-9"], "known models: Qwen/Qwen2.5-7B-Instruct"),
        (["--kv-capacity", "0"], "--kv-capacity must be positive"),
        (["--kv-capacity", "-5"], "--kv-capacity must be positive"),
        (["--kv-capacity", "many"], "whole number of tokens"),
        (["--kv-capacity", "4096"], "below the context length (131072 tokens)"),
        (["--gpu-memory", "24"], "lower --max-model-len"),
        (["--max-model-len", "200000"], "exceeds meta-llama/Llama-3.1-8B-Instruct's context"),
        (["--max-model-len", "0"], "--max-model-len must be positive"),
        (["--gpu-memory", "0"], "GPU memory must be positive"),
        (["--gpu-memory", "16"], "leaves no room for KV cache"),
        (["--gpu-memory", "80", "--gpu-memory-utilization", "1.2"], "must be in (0, 1]"),
        (["--gpu-memory", "80", "--gpu-memory-utilization", "0"], "must be in (0, 1]"),
        (["--gpu-memory", "80", "--activation-memory", "-1"], "must be >= 0"),
        (["--gpu-memory-utilization", "0.8"], "apply with --gpu-memory"),
        (["--gpu-memory", "80", "--kv-capacity", "200000"], "give one"),
        (["--link", "wan=3"], "link classes: node, rack, spine, cluster"),
        (["--link", "rack=0"], "bandwidth must be positive"),
        (["--link", "rack=25,-1"], "setup must be >= 0 ms"),
        (["--link", "rack"], "NAME=GBPS[,SETUP_MS]"),
    ],
)
def test_bad_hardware_options_are_one_line_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--trace", TRACE, *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
