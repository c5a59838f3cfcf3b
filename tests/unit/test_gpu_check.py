"""bench/gpu_check.py: its CPU half runs and writes its JSON; each case is isolated (a case that
raises, hangs or needs more GPUs than there are leaves the others running); the figures it
compares are computed from what a run wrote."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_cpu_half_runs_and_says_what_it_skipped(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-only", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (out,) = tmp_path.glob("gpu-*.json")
    doc = json.loads(out.read_text())
    cases = {c["name"]: c for c in doc["cases"]}
    cpu = [c for c in cases.values() if c["half"] == "cpu"]
    gpu = [c for c in cases.values() if c["half"] == "gpu"]
    assert cpu and gpu and doc["passed"] and doc["finished"] and doc["ran"] == len(cpu) and doc["skipped"] == len(gpu)
    assert all(c["status"] == "passed" for c in cpu), [(c["name"], c.get("reason")) for c in cpu]
    for c in gpu:  # each with its reason: the GPUs it needs, or --cpu-only where they are there
        assert c["status"] == "skipped" and (c["reason"] == "--cpu-only" or c["reason"].startswith(f"needs {c['gpus_needed']} GPU"))
        assert c["name"] in proc.stdout
    mixed = cases["cpu-check-mixed"]
    assert mixed["check"]["ok"] and mixed["run"]["simulated"] and mixed["run"]["backend"] == "gloo"
    assert [m["device"] for m in mixed["memory"]] == ["cpu", "cuda:0"]
    # a CPU worker's tensor peak (placer run measures it) beside the plan
    assert all(m["measure"] == "tensor_peak" and m["ratio"] == pytest.approx(m["planned_bytes"] / m["measured_bytes"])
               for m in mixed["memory"])
    assert mixed["step_time"]["measured_s"] > 0 and mixed["step_time"]["ratio"] is None  # CPU workers are no h200
    measure = cases["cpu-measure-single"]["step_time"]  # the difference of a 10- and a 4-step run
    # (its sign too is the machine's: a loaded one can take longer for the 4 steps' start-up)
    assert measure["method"].startswith("(wall_s of 10 steps - wall_s of 4)") and isinstance(measure["measured_s"], float)
    parity = cases["cpu-parity-data"]["parity"]["data"]
    assert parity["generated_median_s"] > 0 and parity["torch_median_s"] > 0
    figures = {(f["case"], f["figure"].split()[0]) for f in doc["figures"]}
    assert {("cpu-parity-data", "parity"), ("cpu-check-mixed", "memory")} <= figures
    assert not any(f["figure"].startswith("step") for f in doc["figures"])  # CPU workers are no h200
    assert doc["machine"]["env"] == {"NVIDIA_TF32_OVERRIDE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_a_case_that_raises_hangs_or_needs_gpus_leaves_the_others_running(gc, tmp_path):
    def boom(ctx):
        raise ValueError("a bug in the case")

    def hang(ctx):  # and starts a process of its own, as placer run starts workers
        ctx.call([sys.executable, "-c", "import subprocess, sys, time\n"
                  f"open({str(tmp_path / 'child')!r}, 'w').write(str(subprocess.Popen(['sleep', '60']).pid))\n"
                  "time.sleep(60)"], "sleep")
        return {"ok": True}

    def fine(ctx):
        rc, out, _ = ctx.call([sys.executable, "-c", "print('hello')"], "hello")
        return {"ok": rc == 0 and out == "hello\n"}

    cases = [gc.Case("boom", "cpu", "raises", 0, boom), gc.Case("hang", "cpu", "sleeps", 0, hang, timeout_s=1),
             gc.Case("two", "gpu", "needs 2", 2, fine), gc.Case("fine", "cpu", "passes", 0, fine)]
    t0 = time.monotonic()
    results = gc.run_cases(cases, 1, work=tmp_path, budget_s=60, say=lambda m: None)
    assert time.monotonic() - t0 < 30
    assert [r["status"] for r in results] == ["error", "timeout", "skipped", "passed"]
    assert "ValueError: a bug in the case" in results[0]["reason"]
    assert "ran past the case's timeout" in results[1]["reason"]
    status = Path(f"/proc/{(tmp_path / 'child').read_text()}/status")  # its child was stopped with it:
    assert not status.exists() or "\nState:\tZ" in status.read_text()  # gone, or dead and not yet reaped
    assert results[2]["reason"] == "needs 2 GPU(s), 1 found"
    assert "2 passed" not in gc.summary(results, {"host": "h", "gpus": [], "torch": "t"})


def test_a_gpu_case_without_the_gpu_fails_with_placers_error(gc, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the case would run")
    case = next(c for c in gc.cases(quick=True) if c.name == "check-mixed")
    (r,) = gc.run_cases([case], 1, work=tmp_path, budget_s=120, say=lambda m: None)  # as if it had one
    assert r["status"] == "failed" and r["reason"].startswith("placer run exited 1")
    assert "R030" in r["log_tail"]  # runtime.simulate is never: no CPU stand-in for a GPU case


def test_figures_compare_the_cuda_peak_and_the_step(gc, tmp_path):
    plan = {"devices": [{"device": "cpu", "total_bytes": 100}, {"device": "cuda:0", "total_bytes": 1000}],
            "time": {"step_s": 0.011}}
    metrics = {"devices": ["cpu", "cuda:0"], "simulated": False,
               "peak_memory": {"cpu": {"peak_bytes": 5000, "measure": "peak_rss_above_import"},
                               "cuda:0": {"peak_bytes": 1050, "measure": "cuda_max_memory_allocated"}}}
    cpu, cuda = gc.memory(plan, metrics)
    assert cpu["ratio"] is None and cuda["ratio"] == pytest.approx(1000 / 1050) and cuda["met"]
    metrics["peak_memory"]["cpu"]["tensor_peak_bytes"] = 200  # a CPU worker's tensors, not its RSS
    assert gc.memory(plan, metrics)[0]["ratio"] == pytest.approx(0.5) and not gc.memory(plan, metrics)[0]["met"]
    (tmp_path / "progress.jsonl").write_text("".join(json.dumps({"step": i + 1, "elapsed_s": 0.5 + 0.01 * i}) + "\n"
                                                     for i in range(20)))
    one = gc.step_time(plan, metrics, tmp_path, "h200")  # a GPU's: the host's intervals are not its step
    assert one["host_median_s"] == pytest.approx(0.01) and one["measured_s"] is None and "two runs" in one["note"]
    metrics.update(wall_s=0.9, steps_trained=20)
    st = gc.step_time(plan, metrics, tmp_path, "h200", {"wall_s": 0.6, "steps_trained": 5})
    assert st["measured_s"] == pytest.approx(0.02) and st["ratio"] == pytest.approx(0.55) and not st["met"]
    cpu_run = {**metrics, "simulated": True}
    assert gc.step_time(plan, cpu_run, tmp_path, "h200")["measured_s"] == pytest.approx(0.01)  # CPU: the intervals
    (tmp_path / "progress.jsonl").write_text(json.dumps({"step": 1, "elapsed_s": 0.1}) + "\n")
    assert "too few" in gc.step_time(plan, cpu_run, tmp_path, "h200")["note"]
    rows = gc.figures([{"name": "c", "memory": [cpu, cuda], "step_time": st}])
    assert [(what, met) for _, what, _, _, met in rows] == [("memory cuda:0 planned/measured", True),
                                                            ("step predicted (h200)/measured", False)]


def test_a_missing_package_is_said_before_any_case(gc, monkeypatch):
    assert gc.preflight() is None
    monkeypatch.setattr(gc, "PREFLIGHT", "import placer_no_such_package")
    assert "No module named 'placer_no_such_package'" in gc.preflight()


def test_every_case_would_run_a_valid_spec(gc):
    """The GPU half cannot run here: its specs and --set values plan, its parity modes run on cuda."""
    import placer

    vs_torch = sys.modules["vs_torch"]
    for case in gc.cases(quick=False):
        if hasattr(case.run, "spec"):
            report = placer.plan(placer.load(str(ROOT / case.run.spec), overrides=case.run.sets))
            devices = [d["device"] for d in json.loads(report.to_json())["devices"]]
            assert sum(d.startswith("cuda") for d in devices) >= case.gpus, (case.name, devices)
        else:
            assert set(case.run.modes) <= set(vs_torch.CUDA_MODES if case.run.device == "cuda" else vs_torch.MODES)
