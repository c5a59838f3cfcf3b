"""How `placer run` reports a failed run: one R020 naming the rank that failed first, its
device and its exception once (the whole message), then the ranks it took down."""

import signal
from pathlib import Path
from types import SimpleNamespace

from placer.cli.failures import failure_report, failures_in_order, restart_lines

SPEC = SimpleNamespace(file="spec.yaml", training=SimpleNamespace(checkpoint=None))
DEVICES = ["cuda:0", "cuda:1", "cuda:2"]
TERM, ABRT = -signal.SIGTERM, -signal.SIGABRT


def report(failures):
    return failure_report(SPEC, DEVICES, Path("run"), failures)


def test_a_rank_that_aborted_comes_before_those_the_launcher_stopped():
    # the launcher sends SIGTERM to the survivors; rank 1 aborted on its own
    d = report({0: (TERM, ""), 1: (ABRT, "terminate called without an active exception"), 2: (TERM, "")})
    first, took = d.message.splitlines()
    assert first == "rank 1 (cuda:1) was stopped by SIGABRT: terminate called without an active exception"
    assert took == "  it took down: rank 0 (cuda:0), stopped by SIGTERM; rank 2 (cuda:2), stopped by SIGTERM"
    assert d.code == "R020" and d.hint == f"its whole output is in {Path('run/logs/cuda-1.log')}"


def test_an_error_exit_comes_before_any_signal():
    d = report({0: (ABRT, ""), 1: (TERM, ""), 2: (1, "RuntimeError: boom")})
    assert d.message.startswith("rank 2 (cuda:2) exited with code 1: RuntimeError: boom\n")
    assert d.message.count("boom") == 1


# the log of a rank that called fully_shard on a ModuleList: the message holds the list's repr
REPR = "\n".join(f"  ({i}): Linear(in_features=16, out_features=16, bias=True)" for i in range(12)) + "\n)"
FSDP_TAIL = """Traceback (most recent call last):
  File "/tmp/run/program.py", line 142, in train
    seg0 = fully_shard_segment(stage, g0, device.type)  # gradients reduce-scattered in backward
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_init.py", line 45, in _validate_module
    raise ValueError(
ValueError: fully_shard does not support containers that do not implement forward: ModuleList(
""" + REPR + "\n[W1125 01:02:03.000000000 ProcessGroupGloo.cpp:1] Warning: a C++ log line after the traceback"

# what a peer of a failed rank prints: its collective lost the other side
PEER_TAIL = """Traceback (most recent call last):
  File "/tmp/run/program.py", line 150, in train
    dist.all_reduce(total)
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"""


def test_the_first_failure_shows_its_whole_message_once_and_names_the_ranks_it_took_down():
    d = report({0: (1, PEER_TAIL), 1: (1, FSDP_TAIL), 2: (TERM, "")})
    lines = d.message.splitlines()
    # rank 1 failed on its own; rank 0 failed because rank 1 was gone: rank 1 is the cause
    assert lines[0] == ("rank 1 (cuda:1) exited with code 1: ValueError: fully_shard does not support containers "
                        "that do not implement forward: ModuleList(")
    assert [line.removeprefix("    ") for line in lines[1:14]] == REPR.splitlines()  # the whole repr, not its tail
    # one short line each: the gloo error's text is the log's, not the report's
    assert lines[14] == ("  it took down: rank 0 (cuda:0), lost a peer (Connection closed by peer); "
                         "rank 2 (cuda:2), stopped by SIGTERM")
    assert len(lines) == 15 and "C++ log line" not in d.message
    assert d.format().count("ValueError") == 1


def test_a_restart_names_the_exception_line():
    said = restart_lines(SPEC, DEVICES, 1, 2, {0: (1, FSDP_TAIL)}, 0)
    assert said[1] == ("  rank 0 (cuda:0) exited with code 1: ValueError: fully_shard does not support "
                       "containers that do not implement forward: ModuleList(")


def test_output_without_a_traceback_shows_its_last_lines():
    tail = "\n".join(f"line {i}" for i in range(20))
    d = report({0: (1, tail)})
    assert d.message.splitlines() == ["rank 0 (cuda:0) exited with code 1: line 12", *(f"    line {i}" for i in range(13, 20))]


def test_the_cause_is_ordered_first_whatever_the_ranks():
    order = failures_in_order({0: (1, PEER_TAIL), 1: (TERM, ""), 2: (1, "Traceback\n  File \"x\", line 1\nKeyError: 3")})
    assert [rank for rank, _ in order] == [2, 0, 1]


def _raised(msg: str) -> str:
    return f'Traceback (most recent call last):\n  File "program.py", line 3, in <module>\n    step()\n{msg}\n'


def test_ranks_that_raise_the_same_exception_are_one_line():
    """T5 under tensor before its bias was split: every rank raised the same RuntimeError, and
    the report said rank 0 had taken rank 1 down."""
    same = _raised("RuntimeError: The size of tensor a (2) must match the size of tensor b (4)")
    d = report({0: (1, same), 1: (1, same), 2: (TERM, "")})
    first, took = d.message.splitlines()
    assert first == ("ranks 0 (cuda:0) and 1 (cuda:1) exited with code 1: RuntimeError: The size of tensor a (2) "
                     "must match the size of tensor b (4)")
    assert took == "  it took down: rank 2 (cuda:2), stopped by SIGTERM"


def test_a_rank_that_failed_by_itself_is_told_apart_from_one_taken_down():
    peer = _raised("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    d = report({0: (1, _raised("ValueError: bad batch")), 1: (1, _raised("KeyError: 'w'")), 2: (1, peer)})
    lines = d.message.splitlines()
    assert lines[0] == "rank 0 (cuda:0) exited with code 1: ValueError: bad batch"
    assert lines[1] == "  also failed by itself: rank 1 (cuda:1), exited with code 1 (KeyError: 'w')"
    assert lines[2] == "  it took down: rank 2 (cuda:2), lost a peer (Connection closed by peer)"


def test_a_rank_killed_by_a_signal_is_named_before_the_peers_its_death_failed():
    """SIGKILL (what the out-of-memory killer sends) on rank 1: rank 0's collective lost it. Rank 1
    is the cause (rank 0 was named first before, with 1 KB of gloo text)."""
    d = report({0: (1, PEER_TAIL), 1: (-signal.SIGKILL, "")})
    lines = d.message.splitlines()
    assert lines[0] == "rank 1 (cuda:1) was stopped by SIGKILL"
    assert "out-of-memory killer" in lines[1]
    assert lines[2] == "  it took down: rank 0 (cuda:0), lost a peer (Connection closed by peer)"


def test_a_sigkilled_rank_is_reported_with_its_measured_peak_memory():
    statuses = {1: {"step": 3, "phase": "forward", "op": "", "peak": 3 * 2**30}}
    d = failure_report(SPEC, DEVICES, Path("run"), {0: (1, PEER_TAIL), 1: (-signal.SIGKILL, "")}, statuses,
                       {"cuda:1": 2**30})
    assert d.message.splitlines()[1] == ("  (SIGKILL is what the out-of-memory killer sends; its peak memory by step 3 "
                                         "was 3.0 GiB (the plan's estimate: 1.0 GiB): see the plan's memory for this "
                                         "device)")


def test_a_log_line_is_never_shown_as_the_exception_of_a_rank_that_said_nothing():
    """os._exit(3) in forward: the log holds only the program's notices, none of them its error."""
    tail = "simulating 2 devices as CPU workers on gloo: --simulate\nstep 1/4  loss 1.386294  60 samples/s"
    d = failure_report(SPEC, DEVICES, Path("run"), {1: (3, tail), 0: (1, PEER_TAIL)},
                       {1: {"step": 2, "phase": "forward", "op": "", "peak": 0}})
    assert d.message.splitlines()[0] == ("rank 1 (cuda:1) exited with code 3 at step 2 in forward without a word "
                                         "(no exception: os._exit, or native code)")
    assert restart_lines(SPEC, DEVICES, 1, 2, {1: (3, tail)}, 1)[1] == "  rank 1 (cuda:1) exited with code 3"
