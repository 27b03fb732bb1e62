"""Where the measured profiles are (the files this reads, relative to the profiles folder),
where the fitted JSON goes, and how their CSV files are read."""

from __future__ import annotations

import csv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PROFILES = REPO.parent / "shared" / "profiles"
OUT_DIR = REPO / "kvsched" / "data" / "latency"

# Relative paths inside the profiles folder.
BLIS_COEFFS = "blis/blackbox_step_coeffs.csv"
BLIS_HARDWARE = "blis/hardware_config.json"
VIDUR_H100_MLP = "vidur/h100/meta-llama/Llama-2-7b-hf/mlp.csv"
VIDUR_A100_MLP = "vidur/a100/meta-llama/Meta-Llama-3-8B/mlp.csv"
VIDUR_A100_ATTN = "vidur/a100/meta-llama/Meta-Llama-3-8B/attention_samples.csv"
SPLITWISE = "splitwise/perf_model.csv"
DISTSERVE_CAPACITY = "distserve/max_num_tokens.csv"


def read_csv(path: Path) -> list[dict[str, str]]:
    """CSV rows as dicts; lines starting with '#' are comments."""
    with path.open(encoding="utf-8") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))
