"""What a run leaves for the person who has to understand it: `data inspect` shows the
sample as the model sees it with exactly the answer marked; `--auto-batch` keeps the
effective batch and refuses when nothing fits; the support memo of a failure holds what a
helper asks for first and no secret of the environment."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lorastack.chat_data import load_jsonl
from trainer.auto_batch import choose
from trainer.errors import TrainingOOM
from trainer.metrics import write_support_bundle


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
