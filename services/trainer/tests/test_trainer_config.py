"""Run config: YAML + key=value overrides, errors that name the field, the resume hash."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pytest

from lorastack.errors import ConfigError
from trainer.config import load_config, parse_overrides, with_overrides
from trainer.data.batching import Plan, lr_factor

DEMO = Path(str(files("trainer") / "configs" / "demo.yaml"))  # package data


def test_demo_config_loads_with_overrides() -> None:
    cfg = load_config(DEMO, ["lora.r=16", "lr=1e-4", "lora.target_modules=[q_proj,v_proj]"])
    assert cfg.lora.r == 16 and cfg.lr == 1e-4 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.base_model == "smollm2-135m-instruct" and cfg.quantization == "none"


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["lora.r=0"], "lora.r"),
        (["quantization=int3"], "quantization"),
        (["micro_batch=two"], "micro_batch"),
        (["lorra.r=4"], "lorra"),
        (["split.test=0.5", "split.validation=0.5"], "split"),
        (["output=../x"], "output"),
    ],
)
def test_errors_name_the_field(overrides: list[str], names: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, overrides)
    assert names in e.value.message and e.value.hint


def test_fsdp_refuses_qlora_and_forced_compile_and_keeps_auto_eager() -> None:
    import torch

    from trainer.model.compiling import use_compile

    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["distributed=fsdp", "quantization=nf4"])
    assert "quantization: none" in e.value.message and "distributed: ddp" in e.value.message
    with pytest.raises(ConfigError, match="compile: auto"):
        load_config(DEMO, ["distributed=fsdp", "compile=true"])
    with pytest.raises(ConfigError, match="distributed"):
        load_config(DEMO, ["distributed=zero3"])
    cfg = load_config(DEMO, ["distributed=fsdp", "gradient_checkpointing=true"])
    assert not use_compile(cfg, torch.device("cuda"))  # auto: eager under FSDP
    assert with_overrides(cfg, ["distributed=ddp"]).config_hash() != cfg.config_hash()


def test_override_syntax_and_missing_file(tmp_path: Path) -> None:
    assert parse_overrides(["a.b=1", "a.c=x"]) == {"a": {"b": 1, "c": "x"}}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["lora.r"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_config_hash_ignores_only_safe_fields() -> None:
    cfg = load_config(DEMO)
    assert (
        with_overrides(cfg, ["max_steps=7", "keep_checkpoints=5"]).config_hash()
        == cfg.config_hash()
    )
    assert with_overrides(cfg, ["lr=3e-4"]).config_hash() != cfg.config_hash()


def test_batch_order_is_a_function_of_seed_and_step() -> None:
    n, mb, acc = 10, 2, 2
    plan, other = Plan(7, [5] * n, mb, acc), Plan(8, [5] * n, mb, acc)
    assert plan.steps_per_epoch() == 3
    epoch0 = [i for s in range(3) for g in plan.step(s) for row in g for i in row]
    assert sorted(epoch0) == list(range(10))
    assert all(len(row) == 1 for s in range(6) for g in plan.step(s) for row in g)
    assert plan.step(4) == Plan(7, [5] * n, mb, acc).step(4)
    assert plan.step(3) != other.step(3)
    assert lr_factor(0, 10, 2, "cosine") == 0.5 and lr_factor(2, 10, 2, "cosine") == 1.0
    assert lr_factor(5, 10, 0, "linear") == 0.5 and lr_factor(9, 10, 0, "constant") == 1.0


def test_manifest_diff_lists_unsafe_changes_only() -> None:
    from trainer.publish.checkpoint import manifest_diff

    old = {
        "dataset_digest": "sha256:a",
        "git_commit": "111",
        "libraries": {"torch": "2.13.0"},
        "config": {"lr": 1e-4, "max_steps": 10, "lora": {"r": 8}},
    }
    same = {**old, "git_commit": "222", "config": {**old["config"], "max_steps": 50}}
    assert manifest_diff(old, same) == []
    new = {
        **old,
        "dataset_digest": "sha256:b",
        "libraries": {"torch": "2.14.0"},
        "config": {"lr": 1e-4, "max_steps": 10, "lora": {"r": 16}},
    }
    assert manifest_diff(old, new) == [
        "dataset_digest: 'sha256:a' -> 'sha256:b'",
        "libraries.torch: '2.13.0' -> '2.14.0'",
        "config.lora.r: 8 -> 16",
    ]


def test_a_field_added_at_its_default_is_no_change_on_resume() -> None:
    """A run from before a config field existed (its manifest lacks the field) resumes
    when the field holds its default now; any other value, or a real change, refuses."""
    from trainer.publish.checkpoint import manifest_diff

    now = load_config(DEMO, ["dataset.path=demo-dates.jsonl"]).model_dump(mode="json")
    before = {k: v for k, v in now.items() if k != "report_to"}  # written before report_to
    before["lora"] = {k: v for k, v in now["lora"].items() if k != "dropout"}
    assert now["report_to"] == [] and "report_to" not in before
    assert manifest_diff({"config": before}, {"config": now}) == []
    tensorboard = {**now, "report_to": ["tensorboard"]}
    assert manifest_diff({"config": before}, {"config": tensorboard}) == [
        "config.report_to: None -> ['tensorboard']"
    ]
    changed = {**now, "lr": 3e-4, "lora": {**now["lora"], "dropout": 0.1}}
    assert manifest_diff({"config": before}, {"config": changed}) == [
        "config.lora.dropout: None -> 0.1",
        "config.lr: 0.001 -> 0.0003",
    ]
    # present in both, the default is no excuse: a value that changed to it still counts
    assert manifest_diff({"config": {**now, "report_to": ["tensorboard"]}}, {"config": now}) == [
        "config.report_to: ['tensorboard'] -> []"
    ]
