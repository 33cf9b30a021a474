"""lorastack trainer service: SFT of LoRA/QLoRA adapters with preflight checks,
assistant-only loss, smoke runs, exact resume and metrics.

Entry points: `trainer.cli` (the `lorastack data ...` and `lorastack train ...`
commands) and `trainer.recipe.run_training` (the Python API the pipeline calls).
"""

__version__ = "0.1.0"
