"""The data shipped in `kvsched/data/` loads whatever the working directory holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter whose working directory holds a decoy `kvsched` folder (a checkout,
# as `git clone` names it). The finder below is the one an editable install (`pip install -e`)
# appends to `sys.meta_path`: it maps the project's packages' direct children into the
# checkout, while the top-level name `kvsched` is still found first by the path finder, as a
# namespace package made of the decoy. Inserted first, it also stands in for any editable
# install of another checkout in this environment.
LOAD_FROM_BESIDE_A_DECOY = """
import sys
from importlib.machinery import PathFinder

REPO = sys.argv[1]
PACKAGES = {"kvsched": REPO + "/kvsched", "services": REPO + "/services"}


class EditableFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "services":
            return PathFinder.find_spec(name, [REPO])
        parent = name.rpartition(".")[0]
        return PathFinder.find_spec(name, [PACKAGES[parent]]) if parent in PACKAGES else None


sys.meta_path.insert(0, EditableFinder)

import kvsched
from kvsched.core.latency import load_latency
from services.common.inference_api.model_tokenizer import ModelTokenizer
from services.engine.settings import latency_profile_for_gpu

assert kvsched.__file__ is None, "the decoy did not stand in for the package"
print(load_latency().name)
print(latency_profile_for_gpu("a100", ""))
print(ModelTokenizer().vocab_size)
"""


def test_packaged_data_loads_beside_a_folder_named_kvsched(tmp_path: Path) -> None:
    checkout = tmp_path / "kvsched"
    (checkout / "kvsched").mkdir(parents=True)
    (checkout / "data").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, "-c", LOAD_FROM_BESIDE_A_DECOY, str(REPO)]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["llama-3.1-8b-h100", "llama-3-8b-a100", "4096"]
