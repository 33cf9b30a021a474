"""The loss plot: drawn by the child the run starts at setup, or by the trainer itself
whenever the child cannot (not started, failed, or a stale file left in its place)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainer import plotting
from trainer.plotting import Plotter, plot_losses

TRAIN = {1: 5.0, 2: 4.5, 3: float("nan"), 4: 3.9}
VAL = {4: 4.1}


def test_the_child_draws_what_the_trainer_would(tmp_path: Path) -> None:
    here = plot_losses(TRAIN, VAL, tmp_path / "here.png", "run (train)")
    plotter = Plotter()
    assert plotter.child is not None
    there = plotter.plot(TRAIN, VAL, tmp_path / "there.png", "run (train)")
    assert plotter.child is None  # one plot a child
    assert there.read_bytes() == here.read_bytes()


@pytest.mark.parametrize("executable", ["/nonexistent/python", "/bin/false"])
def test_the_trainer_draws_when_the_child_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, executable: str
) -> None:
    monkeypatch.setattr(plotting.sys, "executable", executable)
    out = tmp_path / "loss.png"
    out.write_text("the plot of an earlier session")  # a resumed run's
    Plotter().plot(TRAIN, VAL, out, "run (train)")
    assert out.read_bytes().startswith(b"\x89PNG")


def test_close_stops_a_child_that_never_plots() -> None:
    plotter = Plotter()
    child = plotter.child
    assert child is not None
    plotter.close()
    assert child.poll() is not None and plotter.child is None
    plotter.close()  # again: nothing left to stop


def test_the_child_exits_on_no_request() -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "trainer.plotting"], input=b"", capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
