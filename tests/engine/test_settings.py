"""Engine flags: environment defaults, the simulator's defaults, GPU → latency profile."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.core.cluster import ClusterConfig, Role, build_cluster
from kvsched.core.cost import pool_load
from services.dataplane.block_hashes import BlockHashes
from services.dataplane.kv_memory import DEFAULT_DIR
from services.engine.model import build_model
from services.engine.settings import EngineSettings, latency_profile_for_gpu, parse


def test_defaults_are_the_simulators_and_flags_read_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSCHED_ENGINE_TIME_SCALE", "0.25")
    s = parse(["--prefix-hash-seed", "5"])
    assert (s.time_scale, s.stream_interval) == (0.25, 1)
    assert s.block_hashes == BlockHashes("sha256", "5")
    model = build_model(s)
    sim = build_cluster(ClusterConfig(n_instances=1))
    assert model.capacity_blocks == sim.capacity_blocks
    assert model.latency == sim.cost.latency and model.spec.chunk_tokens == 8192
    assert model.max_model_len == sim.cost.model.max_model_len
    assert parse([]).block_hashes == BlockHashes()  # vLLM's default: SHA-256, fixed seed
    xxh = [parse(["--prefix-caching-hash-algo", "xxhash"]).block_hashes for _ in range(2)]
    assert xxh[0].seed != xxh[1].seed  # random, like vLLM's when PYTHONHASHSEED is unset


def test_gpu_picks_the_latency_profile_measured_on_it() -> None:
    assert parse(["--gpu", "a100"]).latency_profile == "llama-3-8b-a100"
    assert parse(["--gpu", "H100"]).latency_profile == "llama-3.1-8b-h100"  # one GPU first
    seventy = "meta-llama/Llama-3.1-70B-Instruct"
    assert latency_profile_for_gpu("h100", seventy) == "llama-3.1-70b-h100-tp4"
    with pytest.raises(SystemExit):
        parse(["--gpu", "a100", "--latency-profile", "llama-3.1-8b-h100"])
    with pytest.raises(SystemExit):
        parse(["--gpu", "tpu"])


@pytest.mark.parametrize(
    "argv",
    [["--time-scale", "0"], ["--stream-interval", "0"], ["--event-shape", "json"],
     ["--prefix-caching-hash-algo", "md5"], ["--role", "router"], ["--kv-memory-dir", ""]],
)  # fmt: skip
def test_bad_values_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(argv)


def test_capacity_override_is_in_blocks() -> None:
    assert build_model(EngineSettings(capacity_blocks=100, block_size=32)).capacity_blocks == 100


def test_kv_memory_dir_and_role(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (parse([]).role, parse([]).kv_memory_dir) == (Role.BOTH, DEFAULT_DIR)
    monkeypatch.setenv("KVSCHED_ENGINE_KV_MEMORY_DIR", "kv-here")
    s = parse(["--role", "prefill"])
    assert (s.role, s.kv_memory_dir) == (Role.PREFILL, "kv-here")
    assert parse(["--kv-memory-dir", "there", "--role", "decode"]).kv_memory_dir == "there"


def test_pool_loads_cost_the_engine_what_the_cost_model_prices() -> None:
    settings = parse([])
    default = build_model(settings)
    cost = build_cluster(settings.cluster_config()).cost
    assert default.pool_link == build_cluster(ClusterConfig(n_instances=1)).cost.pool_link
    tokens = 4096.0
    load_s, _ = pool_load(cost, np.array([tokens]), np.array([0.0]))
    assert default.pool_load_s(int(tokens)) == pytest.approx(float(load_s[0]))
    assert default.pool_load_s(0) == 0.0
    slow = build_model(parse(["--pool-bandwidth", "1e9", "--pool-setup", "0.001"]))
    assert slow.pool_load_s(1000) == pytest.approx(0.001 + 1000 * slow.kv_bytes_per_token / 1e9)
    with pytest.raises(SystemExit):
        parse(["--pool-bandwidth", "0"])
    with pytest.raises(SystemExit):
        parse(["--pool-setup", "-1"])
