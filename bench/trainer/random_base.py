"""A model folder of random weights in the shape of another: SRC's config.json, a seeded
random LlamaForCausalLM, and SRC's tokenizer files. For benchmarks on a machine that cannot
receive the real weights (the embedded SmolLM2-135M on a GPU host, for example):

    python3 bench/trainer/random_base.py SRC OUT
"""

import shutil
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TOKENIZER = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)

src, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig.from_pretrained(src)).save_pretrained(out)
for name in TOKENIZER:
    shutil.copy(f"{src}/{name}", out)
