"""Metric sinks: JSON lines (``metrics.jsonl``, one record per logged step, machine-readable) and
TensorBoard event files (tensorboardX, readable by ``tensorboard --logdir WORKDIR/tb``).

``metrics.jsonl`` is the record of the run and TensorBoard a view of it. Opening a writer at
``start_step`` (the step the run starts or resumes from, 0 for a fresh run) drops every record
after it — a killed process may have logged steps past its last checkpoint, or, killed before its
first checkpoint, steps the re-run will log again — and rebuilds ``tb/`` from the kept records, so
after any number of kills and resumes every step is logged once in both.
"""

from __future__ import annotations

import glob
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
    """Appends records to ``metrics.jsonl`` and TensorBoard; opened at ``start_step`` (module)."""

    def __init__(self, workdir: str, *, start_step: int = 0, tensorboard: bool = True):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.truncate_after(start_step)
        self._tb = None
        SummaryWriter = _summary_writer_class() if tensorboard else None
        if SummaryWriter is not None:
            tb_dir = os.path.join(workdir, "tb")
            for old in glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")):
                os.remove(old)  # rebuilt below from the kept records: no step twice, no overlap
            self._tb = SummaryWriter(tb_dir)
            for record in read_jsonl(self.path) if os.path.exists(self.path) else ():
                self._add_scalars(record["step"], record.get("kind", "train"),
                                  {k: v for k, v in record.items() if k not in ("step", "kind")})
            self._tb.flush()

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after ``step``."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = [line for line in f if line.strip()]
        keep = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the torn last line of a killed process
            if int(record.get("step", 0)) <= step:
                keep.append(json.dumps(record) + "\n")
        with open(self.path, "w") as f:
            f.writelines(keep)

    def _add_scalars(self, step: int, kind: str, metrics: Mapping) -> None:
        for k, v in metrics.items():
            try:
                # float(): non-finite values are stored in the JSONL as the strings 'nan', 'inf'
                self._tb.add_scalar(f"{kind}/{k}", float(v), int(step))
            except (TypeError, ValueError):
                continue  # a non-numeric field (none are written today)

    def write(self, step: int, metrics: Mapping[str, float], *, kind: str = "train") -> None:
        record = {"step": int(step), "kind": kind}
        for k, v in metrics.items():
            v = float(v)
            record[k] = v if math.isfinite(v) else str(v)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._add_scalars(step, kind, metrics)

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
