"""Metric sinks: JSON lines (``metrics.jsonl``, one record per logged step, machine-readable) and
TensorBoard event files (tensorboardX, readable by ``tensorboard --logdir WORKDIR/tb``).

On resume ``truncate_after(step)`` drops JSONL records written after the restored checkpoint by
the killed process, so the file always describes one consistent run.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Mapping, Optional


def _summary_writer_class():
    """tensorboardX.SummaryWriter without its optional ``import torch`` (4-5 s of start-up for a
    feature we do not use: it only widens which tensor types ``add_scalar`` accepts)."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            return None
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # optional: the JSONL file has everything
        return None
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    def __init__(self, workdir: str, *, tensorboard: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if tensorboard:
            SummaryWriter = _summary_writer_class()
            self._tb = None if SummaryWriter is None else SummaryWriter(os.path.join(workdir, "tb"))

    def truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(self.path, "w") as f:
            f.writelines(keep)

    def write(self, step: int, metrics: Mapping[str, float], *, kind: str = "train") -> None:
        record = {"step": int(step), "kind": kind}
        for k, v in metrics.items():
            v = float(v)
            record[k] = v if math.isfinite(v) else str(v)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(f"{kind}/{k}", float(v), int(step))

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str, kind: Optional[str] = None) -> list[dict]:
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


__all__ = ["MetricsWriter", "read_jsonl"]
