"""A compiled run compiles once: over chats of varied lengths, `lorastack train` with
compile=true (inductor, on the CPU here) builds exactly one graph and breaks it nowhere,
packed or not, per decoder layer or whole; a packed run takes its layer graph from the
disk cache that a child process filled meanwhile (trainer.compile_ahead); and compile=auto
compiles only where the measured eager steps say the compile pays back, choosing the scope
that saves the most."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from lorastack.chat_data import Conversation, write_jsonl
from trainer.config import load_config
from trainer.model.compiling import choose_compile
from trainer.recipe import run_training
from trainer.settings import TrainerSettings

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory: pytest.TempPathFactory, embedded_model: Path) -> Path:
    """A store holding a 2-layer random Llama with the embedded model's tokenizer."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from lorastack.base_model import import_folder

    vocab = AutoConfig.from_pretrained(embedded_model).vocab_size
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=vocab,
        max_position_embeddings=512,
    )
    folder = tmp_path_factory.mktemp("tiny-compile-model")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    for f in embedded_model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
            shutil.copy(f, folder / f.name)
    home = tmp_path_factory.mktemp("tiny-compile-home")
    import_folder(TrainerSettings(home=home, store_url=""), folder, name="tiny-llama")
    return home


def varied_chats(path: Path, n: int = 48) -> Path:
    """Chats from a few to ~250 tokens: micro-batches of many widths."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(n):
        words = int(np.clip(rng.lognormal(3.0, 0.9), 2, 200))
        question = " ".join(rng.choice(WORDS, words))
        answer = " ".join(rng.choice(WORDS, 1 + words // 4))
        rows.append(
            Conversation.model_validate(
                {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
        )
    write_jsonl(path, rows)
    return path


@pytest.mark.parametrize(
    ("packing", "scope", "ahead"),
    [(False, "layers", False), (True, "layers", True), (True, "decoder", False)],
    ids=["padded-layers", "packed-layers-ahead", "packed-decoder"],
)
def test_a_compiled_run_builds_one_graph_without_breaks(
    packing: bool,
    scope: str,
    ahead: bool,
    tiny_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    write_config: Callable[..., Path],
) -> None:
    from torch._dynamo.utils import counters

    monkeypatch.setenv("LORASTACK_HOME", str(tiny_home))
    monkeypatch.setenv("LORASTACK_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.delenv("LORASTACK_STORE_URL", raising=False)
    chats = varied_chats(tmp_path / "chats.jsonl")

    def run(output: str) -> dict[str, int]:
        path = write_config(
            output,
            chats,
            base_model="tiny-llama",
            device="cpu",
            compile=True,
            compile_scope=scope,
            packing=packing,
            gradient_checkpointing=True,
            max_seq_len=512,
            micro_batch=2,
            grad_accum=2,
            max_steps=6,
            epochs=50,  # 38 samples pack into a few rows a step
            eval_every=100,
            checkpoint_every=100,
        )
        torch._dynamo.reset()
        counters.clear()
        result = run_training(load_config(path), TrainerSettings(compile_ahead=ahead))
        assert result.steps == 6 and all(np.isfinite(list(result.losses.values())))
        report: dict[str, int] = result.completion["compile"]
        assert report["graph_breaks"] == 0, dict(counters["graph_break"])
        return report

    # one graph for every layer: the first layer's input asks for its gradient like the
    # others' (otherwise a requires_grad guard fails and a second graph compiles)
    report = run(f"compiled-{scope}-{ahead}")
    assert report["graphs"] == 1
    if ahead:
        # a child process compiled the layer graph while the run prepared: the run took it
        # from the disk cache, AOT autograd's included (the LoRA autograd.Functions made it
        # bypass that cache), and compiled nothing itself
        assert report["fx_cache_misses"] == 0 and report["aot_cache_hits"] == 1, report


def test_compile_auto_compiles_only_where_it_pays() -> None:
    both, cold = ["layers", "decoder"], {"layers": False, "decoder": False}
    # a smoke run's few steps repay no compile
    assert choose_compile(1.5, 6, 32, both, cold)[0] is None
    # a short run takes the graph that compiles in seconds, a long one the whole decoder
    assert choose_compile(1.5, 150, 32, both, cold)[0] == "layers"
    assert choose_compile(1.5, 1000, 32, both, cold)[0] == "decoder"
    # a warm cache makes the whole decoder pay sooner
    assert choose_compile(1.5, 250, 32, ["decoder"], {"decoder": False})[0] is None
    scope, line = choose_compile(1.5, 250, 32, ["decoder"], {"decoder": True})
    assert scope == "decoder"
    assert "250 steps left x 1.50 s eager" in line and "warm cache" in line


def test_auto_steps_on_eagerly_while_a_child_compiles_ahead(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import trainer.model.compiling as compiling
    from trainer.config import RunConfig

    compiled: list[str] = []
    monkeypatch.setattr(compiling, "use_compile", lambda config, device: True)
    monkeypatch.setattr(compiling, "compile_decoder", lambda m, scope, **kw: compiled.append(scope))

    class Child:
        done = False
        stopped = False

        def finished(self) -> bool:
            return self.done

        def wait(self) -> str:
            return "compile ahead: done"

        def stop(self) -> None:
            self.stopped = True

    child = Child()
    config = RunConfig.model_validate(
        {"base_model": "m", "dataset": {"path": "d.jsonl"}, "packing": True, "compile": "auto"}
    )
    run = compiling.CompileRun(
        config,
        torch.device("cpu"),
        {"num_hidden_layers": 16},
        tmp_path,
        child,  # type: ignore[arg-type]
    )
    assert run.after_step(None, 1, 0.5, 150) is None
    line = run.after_step(None, 2, 0.5, 150)  # the probe: layers pay, the child is not done
    assert line is not None and "compiling layers" in line and "eager until" in line
    assert run.after_step(None, 3, 0.5, 147) is None and compiled == [] and not run.active
    child.done = True
    assert run.after_step(None, 4, 0.5, 146) is None
    assert compiled == ["layers"] and run.active and child.stopped
    report = run.after_step(None, 5, 0.4, 145)
    assert report is not None and report.endswith("compile ahead: done")
