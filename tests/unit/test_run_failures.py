"""How `placer run` names the ranks of a failed run: the cause first, then the ranks the
launcher stopped because of it."""

import signal
from pathlib import Path
from types import SimpleNamespace

from placer.cli.run_cmd import _failure, failures_in_order

SPEC = SimpleNamespace(file="spec.yaml")
PROGRAM = SimpleNamespace(devices=["cuda:0", "cuda:1", "cuda:2"])
TERM, ABRT = -signal.SIGTERM, -signal.SIGABRT


def messages(failures):
    order = failures_in_order(failures)
    first = order[0][0]
    return [_failure(SPEC, PROGRAM, Path("run"), r, code, tail, after=None if r == first else first).message
            for r, (code, tail) in order]


def test_a_rank_that_aborted_comes_before_those_the_launcher_stopped():
    # the launcher sends SIGTERM to the survivors; rank 1 aborted on its own
    failures = {0: (TERM, ""), 1: (ABRT, "terminate called without an active exception"), 2: (TERM, "")}
    first, *rest = messages(failures)
    assert first.startswith("rank 1 (cuda:1) was stopped by SIGABRT:")
    assert "terminate called without an active exception" in first
    assert rest == ["rank 0 (cuda:0) was stopped by SIGTERM after rank 1 failed",
                    "rank 2 (cuda:2) was stopped by SIGTERM after rank 1 failed"]


def test_an_error_exit_comes_before_any_signal():
    failures = {0: (ABRT, ""), 1: (TERM, ""), 2: (1, "RuntimeError: boom")}
    first, second, third = messages(failures)
    assert first.startswith("rank 2 (cuda:2) exited with code 1:") and "RuntimeError: boom" in first
    assert second == "rank 0 (cuda:0) was stopped by SIGABRT after rank 2 failed"
    assert third == "rank 1 (cuda:1) was stopped by SIGTERM after rank 2 failed"


# the log of a rank that called fully_shard on a ModuleList: the message holds the list's repr
FSDP_TAIL = """Traceback (most recent call last):
  File "/tmp/run/program.py", line 142, in train
    seg0 = fully_shard_segment(stage, g0, device.type)  # gradients reduce-scattered in backward
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_init.py", line 45, in _validate_module
    raise ValueError(
ValueError: fully_shard does not support containers that do not implement forward: ModuleList(
""" + "\n".join(f"  ({i}): Linear(in_features=16, out_features=16, bias=True)" for i in range(12)) + "\n)"


def test_a_traceback_shows_its_exception_line_not_the_tail_of_a_long_message():
    (message,) = messages({0: (1, FSDP_TAIL)})
    lines = message.splitlines()
    assert lines[1] == "    ValueError: fully_shard does not support containers that do not implement forward: ModuleList("
    assert len(lines) == 9 and lines[-1] == "    ... (7 more lines)"
    # what a restart says of the rank: the exception line, too
    from placer.cli.run_cmd import restart_lines
    spec = SimpleNamespace(file="spec.yaml", training=SimpleNamespace(checkpoint=None))
    said = restart_lines(spec, PROGRAM, 1, 2, {0: (1, FSDP_TAIL)}, 0)
    assert said[1] == ("  rank 0 (cuda:0) exited with code 1: ValueError: fully_shard does not support "
                       "containers that do not implement forward: ModuleList(")


def test_output_without_a_traceback_shows_its_last_lines():
    tail = "\n".join(f"line {i}" for i in range(20))
    (message,) = messages({0: (1, tail)})
    assert message.splitlines()[1:] == [f"    line {i}" for i in range(12, 20)]


def test_a_rank_whose_peer_went_away_comes_after_the_peer():
    """A failed worker exits at once; its peer's collective then fails on the closed connection,
    often before the launcher stops it: the peer that failed first is the cause."""
    gone = ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:45467. "
            "This is typically caused by a remote worker crashing.")
    first, second = messages({0: (1, gone), 1: (1, "RuntimeError: the data source ran dry at step 1")})
    assert first.startswith("rank 1 (cuda:1) exited with code 1:") and second.startswith("rank 0 (cuda:0) exited")
