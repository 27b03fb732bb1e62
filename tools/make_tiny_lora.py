"""Build a tiny random LoRA adapter, with `peft`, for a tiny model that a real vLLM serves.

No hub is reachable, so the adapters real vLLM engines load in development are made here: a
rank-8 adapter on the attention projections of the model at `--base` (e.g. the tiny model of
`tools/make_tiny_model.py`), with seeded random weights on both factors (peft's default
zeroes B, which would make the adapter a no-op), saved as peft saves one: adapter_config.json
and adapter_model.safetensors. Two seeds give two different adapters of the same model.

Run it with the vLLM virtualenv's interpreter (it needs torch, transformers and peft):

    .venv-vllm/bin/python tools/make_tiny_lora.py --base out/models/tiny-llama \\
        --out out/models/tiny-llama-lora-a --seed 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, required=True, help="the model directory")
    parser.add_argument("--out", type=Path, required=True, help="adapter directory to write")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(args.base), local_files_only=True)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        target_modules=TARGETS,
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,  # random A and B: an adapter that changes the output
        task_type="CAUSAL_LM",
    )
    adapted = get_peft_model(model, config)
    args.out.mkdir(parents=True, exist_ok=True)
    adapted.save_pretrained(str(args.out))
    # peft records the base as given; a relative path here would mean nothing elsewhere.
    config_path = args.out / "adapter_config.json"
    saved = json.loads(config_path.read_text(encoding="utf-8"))
    saved["base_model_name_or_path"] = args.base.name
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for path in args.out.iterdir():
        path.chmod(0o644)
    print(f"wrote {args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}")


if __name__ == "__main__":
    main()
