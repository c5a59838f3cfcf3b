"""`python program.py` starts torchrun before it imports torch (the workers import it), and still
checks its arguments first."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from placer.codegen.program import generate
from placer.spec.check import load_spec

SPECS = os.path.join(os.path.dirname(__file__), "..", "..", "specs")

# the program run as `python program.py ARGS`, its torchrun never started: the audit hook
# reports what the process had imported when it was about to start it, and ends it there
PROBE = textwrap.dedent("""
    import os, runpy, sys
    def hook(event, args):
        if event == "subprocess.Popen" and "torch.distributed.run" in list(args[1]):
            print("torchrun", " ".join(map(str, args[1][3:])), "torch imported:", "torch" in sys.modules)
            sys.stdout.flush()
            os._exit(0)
    sys.addaudithook(hook)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch") / "program.py"
    path.write_text(generate(load_spec(os.path.join(SPECS, "mlp_layerwise_direct.yaml")), out_dir=str(path.parent)).text)
    return path


def run(program, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-c", PROBE, str(program), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_python_program_starts_torchrun_without_importing_torch(program):
    proc = run(program, "--steps", "2", "--simulate")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"torchrun --standalone --nproc-per-node=2 {program} --steps 2 --simulate " \
                                  "torch imported: False"


def test_its_arguments_are_checked_before_torchrun(program):
    proc = run(program, "--steps", "many")
    assert proc.returncode == 2 and "torchrun" not in proc.stdout
    assert "argument --steps: invalid int value: 'many'" in proc.stderr
    proc = run(program, "--help")
    assert proc.returncode == 0 and "--reference" in proc.stdout and "torchrun" not in proc.stdout


def test_the_rendezvous_names_its_events_from_frames_not_from_inspect_stack():
    """placer's launch swaps torch's inspect.stack()-based name (0.3 s of a run's start) for one
    read from the frames: the same names, and torch's own back after."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    from placer.launch.run import _frame_names

    def caller():
        def recorder():  # as DynamicRendezvousHandler._record calls it: depth 2 is recorder's caller
            return rdzv.get_method_name(), rdzv.get_method_name(1)
        return recorder()

    torch_names, slow = caller(), rdzv.get_method_name
    with _frame_names():
        assert rdzv.get_method_name is not slow and caller() == torch_names == ("caller", "recorder")
        assert rdzv.get_method_name(10_000) == "no_method_name"
    assert rdzv.get_method_name is slow


@pytest.mark.parametrize("max_restarts, nnodes, own", [(0, 1, False), (2, 1, True), (0, 2, True)])
def test_workers_share_the_launchers_store_unless_a_run_may_restart(tmp_path, monkeypatch, max_restarts, nnodes, own):
    """A single attempt on one node shares the rendezvous store with its workers, as torchrun
    does (a store of their own made a run's start vary by +-0.4 s); a restarted attempt needs a
    store without the keys of the one before, and so do several nodes."""
    from torch.distributed.launcher import api

    from placer.launch import run

    seen = {}

    def fake_launch(config, entrypoint):
        def start(*args):
            seen["own"] = os.environ.get(run.SHARED_STORE) == "1"
        return start

    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    monkeypatch.setenv(run.SHARED_STORE, "kept")
    binding = run.Binding(simulate=True, reason=None, backend="gloo", nproc_per_node=2, nnodes=nnodes)
    run.launch(tmp_path / "program.py", tmp_path, binding, devices=["cpu:0", "cpu:1"], max_restarts=max_restarts,
               rdzv_endpoint="127.0.0.1:29999" if nnodes > 1 else None)
    assert seen["own"] is own
    assert os.environ[run.SHARED_STORE] == "kept"  # the caller's setting back afterwards
