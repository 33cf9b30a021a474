"""While a run trains, its metrics are on a Prometheus endpoint (what the dashboard's
training row plots), and the endpoint closes with the run."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorastack_testing.net import free_port
from trainer.config import load_config
from trainer.recipe import TrainResult, run_training
from trainer.settings import TrainerSettings


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("lorastack_trainer_") and s.labels.get("run") == "live"
    }


class _Linger:
    """Stands in for `time` in trainer.loop.live, whose one use is the linger's sleep: the linger
    lasts until the test ends it, after scraping (a real one can be over before a scrape on
    a loaded machine)."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.lingering, self.over = threading.Event(), threading.Event()

    def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        self.lingering.set()
        assert self.over.wait(60), "the test never ended the linger"


def test_a_running_trainer_serves_its_metrics(
    trainer_env: TrainerSettings,
    demo_jsonl: Path,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    settings = trainer_env.model_copy(update={"metrics_port": port})
    config = load_config(
        write_config(
            "live", demo_jsonl, price_per_gpu_hour=2.0, max_cost=1000.0, report_to=["tensorboard"]
        )
    )
    done: list[TrainResult] = []
    thread = threading.Thread(target=lambda: done.append(run_training(config, settings)))
    # the run's end waits for the test (its linger is the test's to end): polling a run of
    # six tiny steps for a moment after its evaluation raced the run's end on a loaded machine
    from trainer.loop import live as live_module

    linger = _Linger()
    monkeypatch.setattr(live_module, "time", linger)
    thread.start()
    deadline = time.monotonic() + 600
    while not linger.lingering.wait(0.1):  # the run's end: its last values, still served
        assert thread.is_alive() and time.monotonic() < deadline, "the run did not end well"
    assert linger.asked == [settings.metrics_linger_s]
    seen = scrape(port)  # the run's last values, still served
    linger.over.set()
    thread.join(timeout=600)
    assert done and done[0].steps == 6
    assert seen["lorastack_trainer_total_steps"] == 6
    assert seen["lorastack_trainer_loss"] > 0 and seen["lorastack_trainer_tokens"] > 0
    assert 0 < seen["lorastack_trainer_supervised_tokens"] < seen["lorastack_trainer_tokens"]
    assert seen["lorastack_trainer_cost"] > 0 and seen["lorastack_trainer_eta_seconds"] >= 0
    assert (
        seen["lorastack_trainer_max_cost"] == 1000 and seen["lorastack_trainer_elapsed_hours"] > 0
    )
    assert seen["lorastack_trainer_val_loss"] > 0  # the evaluation at step 6
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape(port)  # closed with the run
    # report_to: tensorboard wrote the same series as event files TensorBoard reads
    scalars = tensorboard_scalars(trainer_env.resolved_runs_dir / "live" / "tensorboard")
    assert sorted(scalars["train/loss"]) == [1, 2, 3, 4, 5, 6]
    assert scalars["train/loss"][6] == pytest.approx(done[0].losses[6], rel=1e-6)
    assert sorted(scalars["eval/loss"]) == [3, 6]
    assert sorted(scalars["train/learning_rate"]) == [1, 2, 3, 4, 5, 6]
    assert "train/tokens_per_second" in scalars and "train/cost" in scalars


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from the TFRecord event files in `folder`."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + n])  # length, its crc, data, crc
            at += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def test_the_final_values_stay_up_for_the_linger_then_the_endpoint_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainer.loop import live as live_module
    from trainer.loop.live import LiveRun

    linger = _Linger()
    monkeypatch.setattr(live_module, "time", linger)
    port = free_port()
    live = LiveRun("live", 6, port, "127.0.0.1", bar=False)
    live.gauges["step"].set(6)
    closing = threading.Thread(target=live.close, kwargs={"linger_s": 1.5})
    closing.start()
    assert linger.lingering.wait(60)  # the run has ended; its endpoint lingers
    assert linger.asked == [1.5]
    assert scrape(port)["lorastack_trainer_step"] == 6  # after the run's end, before the scrape
    linger.over.set()
    closing.join()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape(port)
