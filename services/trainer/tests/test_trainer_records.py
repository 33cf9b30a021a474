"""What a run leaves for the person who has to understand it: `data inspect` shows the
sample as the model sees it with exactly the answer marked; `--auto-batch` keeps the
effective batch and refuses when nothing fits; the support memo of a failure holds what a
helper asks for first and no secret of the environment."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lorastack.chat_data import load_jsonl
from trainer.errors import TrainingOOM
from trainer.model.auto_batch import choose
from trainer.support_bundle import write_support_bundle


def test_data_inspect_marks_the_answer_and_its_end_of_turn_only(
    trainer_env: object, demo_jsonl: Path, write_config: Callable[..., Path]
) -> None:
    cfg = write_config("inspect", demo_jsonl)
    out = subprocess.run(
        [sys.executable, "-m", "lorastack.cli", "data", "inspect", str(cfg), "--index", "0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rendered = out.stdout.split("⟧ ---\n", 1)[1].split("--- tokens")[0]
    marked = rendered.split("⟦")[1:]
    assert len(marked) == 1  # one assistant turn, one supervised span
    answer = marked[0].split("⟧")[0]
    convs = {c.messages[-1].content for c in load_jsonl(demo_jsonl)}
    assert answer.removesuffix("<|im_end|>") in convs and answer.endswith("<|im_end|>")
    assert "supervised" in out.stdout.splitlines()[0]
    plus = [ln for ln in out.stdout.splitlines() if ln[6:8] == "+ "]
    assert len(plus) == int(out.stdout.split("supervised ")[1].split(" ")[0])


def test_auto_batch_keeps_the_effective_batch_within_a_memory_budget() -> None:
    row = 3  # GiB one row of the widest batch takes, in a simulated 16 GiB budget
    fits = lambda mb: mb * row <= 16  # noqa: E731
    assert choose(16, fits, 2048) == (4, 4)  # 8 rows would need 24 GiB
    assert choose(6, fits, 2048) == (2, 3)  # powers of two that divide 6: 1, 2
    assert choose(1, fits, 2048) == (1, 1)
    with pytest.raises(TrainingOOM, match="even micro_batch=1 at 4096 tokens") as err:
        choose(8, lambda mb: False, 4096)
    assert "micro_batch" in err.value.hint


def test_the_support_memo_holds_the_facts_and_no_secret(tmp_path: Path) -> None:
    facts = {"step": 41, "failing_step": 42, "max_seq_len": 2048, "micro_batch": 4,
             "grad_accum": 2, "template": {"text": "{% for m in messages %}..."}}  # fmt: skip
    env = {
        "HF_TOKEN": "hf_abcdefabcdef",
        "LORASTACK_S3_SECRET_ACCESS_KEY": "wJalrXUtnFEMI",
        "MY_NOTE": "sk-live-123456",
        "CUDA_VISIBLE_DEVICES": "0",
        "LORASTACK_HOME": "/data/lorastack",
    }
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    path = write_support_bundle(tmp_path / "b.json", oom, facts, [f"l{i}" for i in range(30)], env)
    text = path.read_text()
    for secret in ("hf_abcdefabcdef", "wJalrXUtnFEMI", "sk-live-123456"):
        assert secret not in text
    import json

    bundle = json.loads(text)
    assert bundle["environment"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert bundle["environment"]["HF_TOKEN"] == "<redacted>"
    assert bundle["failing_step"] == 42 and bundle["micro_batch"] == 4
    assert bundle["template"]["text"].startswith("{% for m")
    assert bundle["last_log_lines"] == [f"l{i}" for i in range(10, 30)]
    assert bundle["oom"] and "micro_batch" in bundle["hint"]
    assert bundle["libraries"]["torch"] == torch.__version__.split("+")[0] or bundle["libraries"][
        "torch"
    ].startswith(torch.__version__.split("+")[0])


# What `lorastack train` measured (bytes; training-complete.json's memory_parts): the demo on
# this CPU (`make demo`'s config, 3 steps; and with lora.dropout=0), and on an H200 (1B and
# 8B widths, bench/trainer/results/2026-12-01-6e8dad9.json). Each shape's config, micro-batch
# and widest row as those runs had them.
SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
LLAMA = {
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 49152,
    "tie_word_embeddings": False,
}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MEASURED = [  # (config, estimate arguments, measured step, measured total)
    (SMOLLM2, {"r": 8, "quantization": "none", "compute_bytes": 4, "micro_batch": 4,
               "seq_len": 76, "checkpointed": 0, "lora_dropout": 0.05},
     1_432_343_408, 1_999_712_256),
    (SMOLLM2, {"r": 8, "quantization": "none", "compute_bytes": 4, "micro_batch": 4,
               "seq_len": 76, "checkpointed": 0, "lora_dropout": 0.0},
     1_009_566_576, 1_576_935_424),
    (LLAMA | {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16},
     {"r": 16, "quantization": "nf4", "compute_bytes": 2, "micro_batch": 2, "seq_len": 2048,
      "checkpointed": 16, "cuda": True}, 929_466_368, 2_036_851_200),
    (LLAMA | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8},
     {"r": 16, "quantization": "nf4", "compute_bytes": 2, "micro_batch": 4, "seq_len": 2048,
      "checkpointed": 8, "cuda": True}, 2_785_740_800, 4_684_345_856),
    # the same without checkpointing, its layer graph compiled (2026-12-02, 1826ebf)
    (LLAMA | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8},
     {"r": 16, "quantization": "nf4", "compute_bytes": 2, "micro_batch": 4, "seq_len": 2048,
      "checkpointed": 0, "cuda": True}, 14_586_422_272, 16_485_027_328),
    (LLAMA | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32},
     {"r": 16, "quantization": "nf4", "compute_bytes": 2, "micro_batch": 4, "seq_len": 2048,
      "checkpointed": 32, "cuda": True}, 4_405_594_112, 9_382_736_384),
]  # fmt: skip


@pytest.mark.parametrize(("cfg", "args", "step", "total"), MEASURED)
def test_the_memory_estimate_holds_to_what_runs_measured(
    cfg: dict[str, Any], args: dict[str, Any], step: int, total: int
) -> None:
    """The estimate stays within 15% of the measured peak, and of the step's part, for the
    CPU demo and the H200 shapes: a change to trainer.model.memory that breaks a measured case
    fails here, not in a user's run."""
    from trainer.model.memory import against_measured, estimate

    est = estimate(cfg, targets=ALL_LINEAR, **args)
    parts = against_measured(est, {"step": step, "total": total})
    assert abs(parts["total"]["error"] or 0) <= 0.15, parts
    assert abs(parts["step"]["error"] or 0) <= 0.20, parts  # the 1B's step: -19%
