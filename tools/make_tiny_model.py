"""Build a tiny random-weight model that a real vLLM serves, around a tokenizer directory.

No model hub is reachable from the machines this project runs on, so the models a real vLLM
engine serves in development are made here: a 2-layer LlamaForCausalLM (or, with
`--architecture qwen2`, a Qwen2ForCausalLM: Qwen2's biases on the query, key and value
projections) with seeded random weights (reproducible: the same arguments give the same
bytes), the smallest dimensions vLLM's CPU attention backend accepts (head_size 32, its
smallest supported), and every file of the tokenizer directory: by default the demo one,
`kvsched/data/tokenizer/` (4,096 tokens; `<|begin_of_text|>` = 0, `<|end_of_text|>` = 1);
`--tokenizer DIR` takes another, e.g. a family of `tests/data/tokenizers/`. The vocabulary
size, the BOS, EOS and pad ids and the context length come from the tokenizer.

Run it with the vLLM virtualenv's interpreter (it needs torch, transformers, safetensors):

    .venv-vllm/bin/python tools/make_tiny_model.py --out out/models/tiny-llama
    .venv-vllm/bin/python tools/make_tiny_model.py --out out/models/tiny-qwen2 \\
        --architecture qwen2 --tokenizer tests/data/tokenizers/qwen2
    .venv-vllm/bin/python tools/make_tiny_model.py --out out/models/tiny-mistral \\
        --tokenizer tests/data/tokenizers/mistral

It writes config.json, generation_config.json, model.safetensors and the tokenizer files
(plus a minimal tokenizer_config.json when the demo tokenizer has none). Its output says
nothing: it generates noise, quickly, with real KV geometry and real prefix caching.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = ROOT / "kvsched" / "data" / "tokenizer"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"  # the demo tokenizer's
# vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py) supports head sizes 32, 64,
# 80, ... 512; 32 is the smallest.
HEAD_DIM = 32
# Llama-3.1-8B's context, as the simulated engines model: agentic prompts fit. The context
# where the tokenizer names none (transformers' "no limit" is a huge number).
DEFAULT_CONTEXT = 131_072
MAX_CONTEXT = 1 << 24
MODELS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


@dataclass(frozen=True)
class TokenizerInfo:
    """What the model's config takes from its tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    context: int

    @staticmethod
    def read(directory: Path) -> TokenizerInfo:
        """The tokenizer at `directory` as transformers (hence vLLM) loads it."""
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        context = int(tok.model_max_length)
        return TokenizerInfo(
            vocab_size=len(tok),
            # Qwen2 has no BOS token; its configs name <|endoftext|>, its pad token, instead.
            bos_id=tok.bos_token_id if tok.bos_token_id is not None else tok.pad_token_id,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            context=context if 0 < context <= MAX_CONTEXT else DEFAULT_CONTEXT,
        )


def model_config(args: argparse.Namespace, tok: TokenizerInfo) -> dict[str, Any]:
    """config.json, written by hand so that its bytes do not depend on the library versions."""
    common = {
        "vocab_size": tok.vocab_size,
        "hidden_size": args.heads * HEAD_DIM,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings or tok.context,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "dtype": args.dtype,
    }
    if args.architecture == "qwen2":
        # Qwen2.5's settings; Qwen2 has biases on q, k and v (no attention_bias key: the
        # model classes always make them) and head_dim = hidden_size / heads.
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **common,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.layers,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common,
        "head_dim": HEAD_DIM,
        # transformers 5 reads rope_parameters, older releases rope_theta.
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def generation_config(tok: TokenizerInfo) -> dict[str, Any]:
    config: dict[str, Any] = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    if tok.pad_id is not None:
        config["pad_token_id"] = tok.pad_id
    return config


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_weights(config: dict[str, Any], seed: int, dtype: str, path: Path) -> None:
    config_class, model_class = MODELS[config["model_type"]]
    hf_config = config_class(**{k: v for k, v in config.items() if k != "architectures"})
    torch.manual_seed(seed)
    model = model_class(hf_config).to(getattr(torch, dtype))
    tensors = {name: t.detach().contiguous() for name, t in sorted(model.state_dict().items())}
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates it owner-only


def copy_tokenizer(source: Path, out: Path) -> list[str]:
    names = []
    for src in sorted(source.iterdir()):
        if src.is_file():
            shutil.copyfile(src, out / src.name)
            names.append(src.name)
    if not (out / "tokenizer_config.json").exists():
        if source.resolve() != TOKENIZER_DIR.resolve():
            raise SystemExit(f"{source} has no tokenizer_config.json")
        write_json(
            out / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "model_max_length": DEFAULT_CONTEXT,
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
    parser.add_argument(
        "--tokenizer", type=Path, default=TOKENIZER_DIR, help="tokenizer directory to copy"
    )
    parser.add_argument("--architecture", choices=sorted(MODELS), default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2, help=f"query heads of {HEAD_DIM} dims")
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        default=0,
        help=f"default: the tokenizer's model_max_length (else {DEFAULT_CONTEXT})",
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # A stale tokenizer_config.json from an earlier run must not hide the source's absence,
    # nor a stale chat_template.jinja (it wins over the config's template) come along.
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)
    copied = copy_tokenizer(args.tokenizer, out)
    tok = TokenizerInfo.read(out)
    config = model_config(args, tok)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(tok))
    write_weights(config, args.seed, args.dtype, out / "model.safetensors")
    print(f"wrote {out}: config.json, generation_config.json, model.safetensors, {copied}")


if __name__ == "__main__":
    main()
