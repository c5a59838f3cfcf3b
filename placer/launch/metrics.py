"""Every step's figures, for plotting: RUN_DIR/metrics.csv (a spreadsheet opens it) and TensorBoard
event files under RUN_DIR/tensorboard/ (`tensorboard --logdir RUN_DIR`).

Written by `placer run` from the program's progress.jsonl as it grows, so the program does no
extra work for them: rank 0 reads its step time, learning rate and memory locally, and the loss
comes from the all-reduce that BatchLosses already runs a step behind.
"""
from __future__ import annotations

import contextlib
import csv
import importlib.util
import math
import threading
from pathlib import Path
from typing import Any

CSV = "metrics.csv"
TENSORBOARD = "tensorboard"
COLUMNS = ("step", "loss", "lr", "grad_norm", "samples_per_s", "step_s", "memory_bytes", "elapsed_s")
"""metrics.csv's columns. samples_per_s and step_s are the step's own; memory_bytes is rank 0's peak
so far (the CUDA allocator's on a GPU, peak RSS above the RSS after importing torch on a CPU
worker); grad_norm is empty unless the program reports one; lr is the first param group's."""


class MetricsWriter:
    """add(record) for each progress record; close() at the end. `note`: one line to show when
    TensorBoard files cannot be written (None when they are)."""

    def __init__(self, run_dir: Path, batch_size: int, append: bool = False):
        self.batch_size = batch_size
        path = run_dir / CSV
        fresh = not (append and path.exists())
        self.file = open(path, "w" if fresh else "a", newline="")
        self.csv = csv.DictWriter(self.file, COLUMNS, extrasaction="ignore")
        if fresh:
            self.csv.writeheader()
        # The SummaryWriter is made at the first step, not here: importing it takes 0.3-1 s that
        # would delay the workers' start (issue 15); find_spec only looks for the package.
        self.board: Any = None
        self.board_dir: Path | None = run_dir / TENSORBOARD
        self.note: str | None = None
        self.stopped = False  # a write failed: no more rows
        self._hook = threading.excepthook
        if importlib.util.find_spec("tensorboard") is None:
            self.board_dir = None
            self.note = (f"TensorBoard is not installed: no event files, {path.name} has every step "
                         "(pip install 'placer[tensorboard]')")

    def add(self, record: dict) -> None:
        if "step" not in record or self.stopped:  # "resumed_from" and other events
            return
        row = {k: record.get(k) for k in COLUMNS}
        step_s = record.get("step_s")
        row["samples_per_s"] = self.batch_size / step_s if step_s else None
        try:
            self.csv.writerow({k: "" if v is None else v for k, v in row.items()})
            self.file.flush()
            if self.board is None and self.board_dir is not None:
                from torch.utils.tensorboard import SummaryWriter
                self._hook, threading.excepthook = threading.excepthook, self._writer_failed
                self.board_dir, self.board = None, SummaryWriter(log_dir=str(self.board_dir))
            if self.board is not None:
                for name in COLUMNS[1:]:
                    value = row[name]
                    if isinstance(value, (int, float)) and math.isfinite(value):
                        self.board.add_scalar(f"train/{name}", value, record["step"])
        except OSError as e:  # a full disk: the plots stop, the run goes on (its own files say what failed)
            self.stopped, self.note = True, f"metrics.csv and TensorBoard's files stopped at step {record['step']}: {e}"

    def _writer_failed(self, args) -> None:
        """TensorBoard's writer thread could not write (a full disk): one line in the note, not its
        traceback on placer's stderr; the run's own files say what the disk did."""
        if issubclass(args.exc_type, OSError):
            self.note = f"TensorBoard's event files stopped: {args.exc_value}"
        else:
            self._hook(args)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
            if self.board is not None:
                self.board.close()
        threading.excepthook = self._hook
