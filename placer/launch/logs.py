"""Each worker's output in one file named by its device: RUN_DIR/logs/cpu-0.log, logs/cuda-1.log.

torch's elastic launcher opens a worker's stdout and stderr files itself, each with its own
offset, so one file cannot take both; the log gets stderr, and the program (started by
`placer run`) points its stdout at stderr (`die_with_launcher`), so prints and tracebacks
stay in the order they happened.
"""
from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs


def log_name(device: str, attempt: int = 0) -> str:
    """`cuda:1` -> `cuda-1.log`, `node1/cuda:0` -> `node1-cuda-0.log`; a restart's `cuda-1.restart1.log`."""
    stem = device.replace("/", "-").replace(":", "-")
    return f"{stem}.log" if attempt == 0 else f"{stem}.restart{attempt}.log"


class DeviceLogs(LogsSpecs):
    """torch's LogsSpecs, with RUN_DIR/logs/<device>.log per worker instead of
    logs/<run id>/attempt_N/<local rank>/{stdout,stderr}.log."""

    def __init__(self, log_dir: Path, devices: list[str]):
        super().__init__(log_dir=str(log_dir))
        self.devices = devices

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        os.makedirs(self.root_log_dir, exist_ok=True)
        dest = LogsDest(filtered_stdout=os.devnull, filtered_stderr=os.devnull)
        for local_rank, env in envs.items():
            device = self.devices[int(env.get("RANK", local_rank))]
            dest.stdouts[local_rank] = os.devnull  # the program writes it to stderr
            dest.stderrs[local_rank] = os.path.join(self.root_log_dir, log_name(
                device, int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))))
            dest.error_files[local_rank] = os.devnull  # the program uses no @record error files
            env["TORCHELASTIC_ERROR_FILE"] = ""
        return dest


def read_log(run_dir: Path, device: str) -> str:
    """The newest attempt's log of `device` ("" if it wrote none)."""
    stem = log_name(device)[:-len(".log")]
    logs = sorted((run_dir / "logs").glob(f"{stem}*.log"), key=os.path.getmtime)
    logs = [p for p in logs if p.name == f"{stem}.log" or p.name.startswith(f"{stem}.restart")]
    return logs[-1].read_text(errors="replace") if logs else ""
