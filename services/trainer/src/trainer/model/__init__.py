"""The model a run trains.

Loading with LoRA, the fused LoRA layer, attention over packed rows, the loss, compiling,
memory estimates and several processes (DDP, FSDP).
"""
