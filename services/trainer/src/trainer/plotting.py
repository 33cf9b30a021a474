"""The loss plot (`loss.png`), drawn by a child process the run starts at its setup.

Owns `plot_losses` (matplotlib, Agg) and `Plotter`: a child that imports matplotlib and
builds its font cache while the run prepares and steps, then draws the plot from the
series the run sends it at the end. Drawn in the trainer, the first plot cost 0.7-1.1 s
(importing pyplot, the first draw) between the last step and the published adapter; the
waiting child draws it in a fraction of that. A thread would hold the GIL that the first
steps launch with. Whatever goes wrong with the child, the trainer draws the plot itself.

`python -m trainer.plotting` is the child: one JSON request on stdin (nothing: exit).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 120.0  # for the child's plot, then the trainer draws it


def plot_losses(train: dict[int, float], val: dict[int, float], path: Path, title: str) -> Path:
    """Draw the train and validation losses per step to `path` (PNG); returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(list(train), list(train.values()), label="train loss", linewidth=1)
    if val:
        ax.plot(list(val), list(val.values()), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / supervised token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path


class Plotter:
    """The plotting child of one run (see the module docstring)."""

    def __init__(self) -> None:
        try:
            self.child: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", "trainer.plotting"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError:
            self.child = None  # plot() draws in this process

    def plot(self, train: dict[int, float], val: dict[int, float], path: Path, title: str) -> Path:
        """Draw the plot to `path`: by the child, or here when it cannot."""
        child, self.child = self.child, None
        if child is not None:
            path.unlink(missing_ok=True)  # a resumed run's earlier plot
            request = {"train": list(train.items()), "val": list(val.items()),
                       "path": str(path), "title": title}  # fmt: skip
            try:
                child.communicate(json.dumps(request).encode(), timeout=TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                child.kill()
                child.wait()
            if child.returncode == 0 and path.is_file():
                return path
        return plot_losses(train, val, path, title)

    def close(self) -> None:
        """Stop the child of a run that ends without a plot."""
        if self.child is not None:
            self.child.kill()
            self.child.wait()
            self.child = None


def main() -> int:
    """The child: warm matplotlib up, then draw the one request read from stdin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager as fm
    import matplotlib.pyplot  # imported here, while the run trains, not after it

    fm.findfont("DejaVu Sans")  # builds the font cache on a fresh host
    raw = sys.stdin.read()
    if not raw:
        return 0
    request = json.loads(raw)
    train = {int(step): float(loss) for step, loss in request["train"]}
    val = {int(step): float(loss) for step, loss in request["val"]}
    plot_losses(train, val, Path(request["path"]), request["title"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
