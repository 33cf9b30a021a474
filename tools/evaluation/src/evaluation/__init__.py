"""Evaluation tools: is the LoRA better than prompting the base model, how does the
served model behave under load, and what does it cost.

    eval_config, eval_data, eval_run, eval_report   `lorastack eval` (paired, bootstrapped)
    scorers, verdict                                  pure scoring and decision logic
    loadtest_*, prom                                  `lorastack loadtest`
    cost                                              `lorastack cost` (pure arithmetic)
    endpoint                                          the one HTTP transport

Python API (names load lazily, so `lorastack --help` stays fast):

    from evaluation import EvalConfig, run_eval
    report = run_eval(EvalConfig(base_url=..., test="demo/test", base_model="smollm2",
                                 lora_model="demo-adapter"), out_dir=Path("eval"), store=store)
    report.verdicts   # {"exact": "improvement", ...}
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EvalConfig": "evaluation.eval_config",
    "load_eval_config": "evaluation.eval_config",
    "EvalReport": "evaluation.eval_report",
    "run_eval": "evaluation.eval_run",
    "run_eval_async": "evaluation.eval_run",
    "paired_bootstrap": "evaluation.verdict",
    "register_scorer": "evaluation.scorers",
    "LoadtestConfig": "evaluation.loadtest_config",
    "run_loadtest": "evaluation.loadtest_run",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'evaluation' has no attribute {name!r}")
