"""`kvsched bench` replays the live cluster's shape in the simulator: its engines' model config
(KV bytes per token), the latency profile its Conductors price with, and how many engines
share a node."""

from __future__ import annotations

from kvsched.core.latency import load_latency
from kvsched.sim.compare import Comparison, config_section, replay_config
from services.loadgen.__main__ import live_cluster_shape
from tests.conftest import tiny_trace


def test_the_live_model_config_and_node_size_reach_the_simulated_config() -> None:
    endpoints = {
        "model_config": "Qwen/Qwen3-8B",
        "engines": [{"id": "a", "node": "n1"}, {"id": "b", "node": "n1"}, {"id": "c"}],
    }
    trace = tiny_trace([("s", 0.0, 32, 1, (1, 2))])
    cmp = Comparison(trace, "t.jsonl", ("round_robin",), 3, **live_cluster_shape(endpoints))
    config = config_section(cmp, replay_config(cmp))
    assert (config["model"], config["kv_bytes_per_token"]) == ("Qwen/Qwen3-8B", 147_456)
    assert config["hardware"]["model_config"] == "Qwen/Qwen3-8B"
    assert config["topology"]["instances_per_node"] == 2
    assert live_cluster_shape({}) == {}


def test_the_conductors_latency_profile_and_its_capacity_reach_the_simulated_config() -> None:
    endpoints = {"model_config": "Qwen/Qwen3-8B", "latency_profile": "llama-3-8b-a100"}
    trace = tiny_trace([("s", 0.0, 32, 1, (1, 2))])
    cmp = Comparison(trace, "t.jsonl", ("round_robin",), 2, **live_cluster_shape(endpoints))
    config = config_section(cmp, replay_config(cmp))
    profile = load_latency("llama-3-8b-a100")
    assert config["latency_profile"]["name"] == "llama-3-8b-a100"
    assert config["kv_capacity_tokens"] == profile.kv_capacity_tokens
