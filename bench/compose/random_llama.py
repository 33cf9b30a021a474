"""A model folder of Llama-3.1-8B's real shape with random weights and the real SmolLM2
tokenizer, made on the GPU in bfloat16 and saved as safetensors shards (bench/compose):

    python3 bench/compose/random_llama.py --tokenizer DIR --out DIR [--head-scale 8]

config.json is Llama-3.1-8B-Instruct's (written out below), except the token ids, which are
the tokenizer's (SmolLM2: <|im_start|> 1, <|im_end|> 2; its 49,152 ids all fall inside the
128,256 rows). The output head is scaled (default 8) so the next-token distribution is peaked
as a trained model's is (bench/parity/llama_shape.py: at the default init the top two logits
are often within bf16's rounding), and its rows past the tokenizer's 49,152 ids are zero, so a
greedy answer (the walk asks with temperature 0) is text. Small shards (200 MB; the 1 GB
embedding and head alone): the S3 stand-in (moto) reads a whole object for every ranged
16 MiB GET, so downloading a model costs about its size x shard size / 16 MiB of copying
(one 16 GB shard: 16 TB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# meta-llama/Llama-3.1-8B-Instruct's config.json, token ids aside (module docstring)
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def make(
    tokenizer: Path, out: Path, head_scale: float, shard: str, layers: int
) -> dict[str, object]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    start = time.monotonic()
    values = {k: v for k, v in LLAMA31_8B.items() if k != "architectures"}
    config = LlamaConfig(**values | {"num_hidden_layers": layers})
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    from tokenizers import Tokenizer

    known = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).get_vocab_size()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        model.lm_head.weight[known:] = 0  # ids the tokenizer has no text for: never the argmax
    made = time.monotonic() - start
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=shard)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, out / name)
    written = sum(p.stat().st_size for p in out.iterdir())
    return {"device": device, "made_s": round(made, 1), "total_s": round(time.monotonic() - start, 1),
            "bytes": written, "shards": len(list(out.glob("*.safetensors"))), "head_scale": head_scale,
            "tokenizer_ids": known}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokenizer", type=Path, required=True, help="a SmolLM2 tokenizer folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--head-scale", type=float, default=8.0)
    ap.add_argument("--max-shard-size", default="200MB")
    ap.add_argument("--layers", type=int, default=32, help="fewer for a quick check (32: 8B)")
    args = ap.parse_args()
    print(
        json.dumps(
            make(args.tokenizer, args.out, args.head_scale, args.max_shard_size, args.layers)
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
