"""The run's record files: each written atomically as JSON, and read back as a series
(`metrics/metrics-step-N.json` per log interval, `metrics/eval-step-N.json` per evaluation).
What goes into each is its writer's (trainer.loop.progress, trainer.loop.evaluation,
trainer.publish.completion); the live metrics are trainer.loop.live's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON to `path` atomically (a .tmp file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def read_series(metrics_dir: Path, prefix: str, key: str) -> dict[int, float]:
    """{step: value} from metrics_dir/<prefix>-step-N.json files."""
    out = {}
    for p in metrics_dir.glob(f"{prefix}-step-*.json"):
        data = json.loads(p.read_text())
        out[int(data["step"])] = float(data[key])
    return dict(sorted(out.items()))
