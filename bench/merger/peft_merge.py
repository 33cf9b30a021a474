"""PEFT's own merge path, the baseline of merge_e2e.py: base in bf16 on the GPU (the CPU
when there is none), the adapter on top, merge_and_unload(), save_pretrained().

usage: python3 bench/merger/peft_merge.py BASE_DIR ADAPTER_DIR OUT_DIR
"""

import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

base_dir, adapter_dir, out_dir = sys.argv[1:4]
placed = {"device_map": "cuda"} if torch.cuda.is_available() else {}
model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16, **placed)
model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
model.save_pretrained(out_dir)
