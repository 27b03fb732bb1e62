"""Build a tiny random-weight Llama that a real vLLM serves, around the demo tokenizer.

No model hub is reachable from the machines this project runs on, so the model a real vLLM
engine serves in development is made here: a 2-layer LlamaForCausalLM with seeded random
weights (reproducible: the same arguments give the same bytes), the smallest dimensions
vLLM's CPU attention backend accepts (head_size 32, its smallest supported), and every file of
`kvsched/data/tokenizer/` (4,096 tokens; `<|begin_of_text|>` = 0, `<|end_of_text|>` = 1).

Run it with the vLLM virtualenv's interpreter (it needs torch, transformers, safetensors):

    .venv-vllm/bin/python tools/make_tiny_model.py --out out/models/tiny-llama

It writes config.json, generation_config.json, model.safetensors and the tokenizer files
(plus a minimal tokenizer_config.json when the shipped tokenizer has none). Its output says
nothing: it generates noise, quickly, with real KV geometry and real prefix caching.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = ROOT / "kvsched" / "data" / "tokenizer"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
BOS_ID, EOS_ID = 0, 1
VOCAB = 4096
# vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py) supports head sizes 32, 64,
# 80, ... 512; 32 is the smallest.
HEAD_DIM = 32


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """config.json, written by hand so that its bytes do not depend on the library versions."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": args.heads * HEAD_DIM,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        # transformers 5 reads rope_parameters, older releases rope_theta.
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
        "dtype": args.dtype,
    }


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_weights(config: dict[str, Any], seed: int, dtype: str, path: Path) -> None:
    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config).to(getattr(torch, dtype))
    tensors = {name: t.detach().contiguous() for name, t in sorted(model.state_dict().items())}
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates it owner-only


def copy_tokenizer(out: Path, model_max_length: int) -> list[str]:
    names = []
    for src in sorted(TOKENIZER_DIR.iterdir()):
        if src.is_file():
            shutil.copyfile(src, out / src.name)
            names.append(src.name)
    if not (out / "tokenizer_config.json").exists():
        write_json(
            out / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "model_max_length": model_max_length,
                "clean_up_tokenization_spaces": False,
            },
        )
        names.append("tokenizer_config.json (minimal, written)")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2, help=f"query heads of {HEAD_DIM} dims")
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--intermediate-size", type=int, default=128)
    # Llama-3.1-8B's context, as the simulated engines model: agentic prompts fit.
    parser.add_argument("--max-position-embeddings", type=int, default=131_072)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # A stale tokenizer_config.json from an earlier run must not hide the shipped one's absence.
    (out / "tokenizer_config.json").unlink(missing_ok=True)
    config = model_config(args)
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID},
    )
    write_weights(config, args.seed, args.dtype, out / "model.safetensors")
    copied = copy_tokenizer(out, args.max_position_embeddings)
    print(f"wrote {out}: config.json, generation_config.json, model.safetensors, {copied}")


if __name__ == "__main__":
    main()
