"""`lorastack demo`'s inputs: the demo config comes from the trainer package itself."""

from __future__ import annotations

from importlib.resources import files

from lorastack_app.pipeline import demo_config
from trainer.config import load_config


def test_the_demo_config_is_package_data_of_the_trainer() -> None:
    path = demo_config()
    assert path.is_file() and path.parent.parent.name == "trainer"
    assert path.read_bytes() == (files("trainer") / "configs" / "demo.yaml").read_bytes()
    cfg = load_config(path, ["dataset.path=demo-dates.jsonl"])
    assert cfg.base_model == "smollm2-135m-instruct"
