"""Model configs and latency profiles: built-in by name, or read from a user's own JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsched.core.latency import latency_profiles, load_latency
from kvsched.core.models import MODELS, model_config
from kvsched.data_files import data_path


def test_every_built_in_model_knows_its_weights() -> None:
    for model in MODELS.values():
        assert model.weight_bytes > 1e9, model.name


def test_a_model_config_file_is_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"layers": 40, "kv_heads": 8, "head_dim": 128, "params": 14_000}))
    mine = model_config(str(path))
    assert (mine.name, mine.kv_bytes_per_token, mine.weight_bytes) == ("mine", 163_840, 28_000)
    for bad, message in (
        ({"layers": 40, "kv_heads": 8}, "missing head_dim"),
        ({"layers": 40, "kv_heads": 8, "head_dim": 128, "heads": 3}, "unknown heads"),
        ({"layers": 0, "kv_heads": 8, "head_dim": 128}, "layers must be positive"),
        ({"layers": 40, "kv_heads": 8, "head_dim": 1.5}, "head_dim must be an integer"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            model_config(str(path))
    with pytest.raises(ValueError, match="no model config file"):
        model_config(str(tmp_path / "absent.json"))


def test_an_unknown_name_lists_the_known_models_and_profiles() -> None:
    with pytest.raises(ValueError, match="known models: ") as models:
        model_config("gpt-9")
    assert all(name in str(models.value) for name in MODELS)
    with pytest.raises(ValueError) as profiles:
        load_latency("b200")
    shipped = ("llama-3-8b-a100", "llama-3.1-70b-h100-tp4", "llama-3.1-8b-h100")
    assert f"known profiles: {', '.join(shipped)}" in str(profiles.value)
    assert latency_profiles() == shipped


def test_a_latency_profile_file_is_read_and_checked(tmp_path: Path) -> None:
    shipped = json.loads(data_path("latency", "llama-3.1-8b-h100.json").read_text())
    path = tmp_path / "my-gpu.json"
    mine = {k: shipped[k] for k in shipped if k not in ("name", "sources", "checks", "method")}
    path.write_text(json.dumps({**mine, "step_s": 0.01}))
    loaded = load_latency(str(path))
    assert (loaded.name, loaded.step_s) == ("my-gpu", 0.01)
    assert loaded.prefill_token_s == load_latency().prefill_token_s
    assert loaded.request_overhead_s == 0.0  # the GPU profiles time passes only
    assert loaded.prefill_ctx_s == 0.0
    path.write_text(json.dumps({**mine, "request_overhead_s": 0.02, "prefill_ctx_s": 1e-6}))
    server = load_latency(str(path))
    assert (server.request_overhead_s, server.prefill_ctx_s) == (0.02, 1e-6)
    for bad, message in (
        ({**mine, "step_s": 0}, "step_s must be positive"),
        ({**mine, "attn_pair_s": -1e-9}, "attn_pair_s must be finite and >= 0"),
        ({**mine, "decode_seq_s": "fast"}, "decode_seq_s must be a number"),
        ({**mine, "request_overhead_s": -0.1}, "request_overhead_s must be finite and >= 0"),
        ({**mine, "prefill_ctx_s": True}, "prefill_ctx_s must be a number"),
        ({**mine, "kv_capacity_tokens": 0}, "kv_capacity_tokens must be a positive integer"),
        ({k: v for k, v in mine.items() if k != "gpu"}, "missing gpu"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            load_latency(str(path))
    path.write_text("{oops")
    with pytest.raises(ValueError) as garbled:
        load_latency(str(path))
    assert "my-gpu.json" in str(garbled.value)
