"""The cost model on a fixed, round-number hardware profile, against times worked out by hand.

Profile `HW`: 1 GFLOP/s at every size (backward too), memory 1 GB/s, links 1 MB/s, 1 ms per
message and collective, no fixed cost per layer, tensor or step, and an optimizer update of
1 ns per element and slot. The model: a Linear(i, o) forward on b rows is 2*b*i*o FLOPs; a
ReLU moves its input and output through memory (4 bytes an element).
"""
from __future__ import annotations

import json
import textwrap
from dataclasses import replace

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from placer.cli.main import main  # noqa: E402
from placer.cli.plan_cmd import build_and_plan  # noqa: E402
from placer.estimate import calibrate, hardware  # noqa: E402
from placer.estimate.hardware import Hardware, rate  # noqa: E402
from placer.estimate.steptime import pipeline_seconds, step_time  # noqa: E402
from placer.spec.check import load_spec  # noqa: E402

HW = Hardware(name="round", flops=1e9, bf16_flops=1e9, mem_bw=1e9, link_bw=1e6, host_bw=1e9, latency=1e-3,
              collective_s=1e-3, sharded_s=1e-3, split_s=1e-3, action_s=0.0, layer_overhead=0.0, update_s=1e-9,
              tensor_overhead=0.0, step_overhead=0.0, source="by hand")

MODEL = """placer: 1
name: st
model:
  layers:
    - {name: fc1, op: Linear, args: [100, 100]}
    - {name: fc2, op: Linear, args: [100, 100]}
  input: {shape: [B, 100]}
  target: {shape: [B, 100]}
  loss: MSELoss
devices: [cpu:0, cpu:1]
training: {batch_size: 50, steps: 1, optimizer: {op: SGD, lr: 0.1}}
"""
# fc1, fc2: forward 2*50*100*100 = 1 MFLOP each on the whole batch = 1 ms at 1 GFLOP/s; backward 2 ms.
# Parameters 10,100 each (40,400 B); SGD has no state, so an update reads 10,100 elements: 10.1 us.
# The activation between them: 50*100*4 = 20,000 B = 20 ms on a 1 MB/s link.


def timed(tmp_path, placement: str, extra: str = "", hw: Hardware = HW):
    path = tmp_path / "spec.yaml"
    path.write_text(MODEL + textwrap.dedent(placement) + extra)
    graph, plan, est, _ = build_and_plan(load_spec(str(path)))
    return step_time(plan, graph, est, hw), plan, graph


def test_layerwise_is_the_chain_of_both_segments_and_both_copies(tmp_path):
    st, _, _ = timed(tmp_path, "placement:\n  - {layers: fc1, device: cpu:0}\n  - {layers: fc2, device: cpu:1}\n")
    # cpu:0: fwd 1 ms; copy act 1 ms + 20 ms; cpu:1: fwd 1, bwd 2; copy grad 21 ms; cpu:0 bwd 2 ms; update
    assert st.per_device["cpu:1"].compute_s == pytest.approx(3e-3)
    assert st.per_device["cpu:0"].comm_s == pytest.approx(21e-3 + 3e-3 + 21e-3)  # waits for cpu:1's work too
    assert st.step_s == pytest.approx(1e-3 + 21e-3 + 3e-3 + 21e-3 + 2e-3 + 10.1e-6)
    assert st.critical == "cpu:0"


def test_data_parallel_overlaps_its_all_reduce_with_the_backward_unless_told_not_to(tmp_path):
    placement = "placement:\n  - {layers: fc1..fc2, devices: [cpu:0, cpu:1], parallel: {mode: data%s}}\n"
    over, _, _ = timed(tmp_path, placement % "")
    serial, _, _ = timed(tmp_path, placement % ", overlap: false")
    # each device: half the batch, fwd 1 ms + bwd 2 ms; one bucket of 80,800 B all-reduced: each
    # device sends 2(n-1)/n of it = 80,800 B = 80.8 ms + 1 ms fixed
    for st in (over, serial):
        assert st.per_device["cpu:0"].compute_s == pytest.approx(3e-3)
    assert over.per_device["cpu:0"].comm_s == 0 and over.per_device["cpu:0"].overlapped_s == pytest.approx(81.8e-3)
    assert serial.per_device["cpu:0"].comm_s == pytest.approx(81.8e-3)
    # the one bucket holds fc1, the last layer the backward reaches: it is ready only when the
    # backward ends, so overlapping saves nothing here ...
    assert over.step_s == pytest.approx(serial.step_s)
    # ... while on a fast link the two orders still agree on the compute they wait for
    fast = replace(HW, link_bw=1e12, collective_s=0.0)
    quick, _, _ = timed(tmp_path, placement % "", hw=fast)
    assert quick.step_s == pytest.approx(3e-3 + 80.8e-9 + 2 * 10.1e-6)  # the all-reduce after the backward


def test_a_bucket_ready_early_runs_beside_the_rest_of_the_backward(tmp_path):
    placement = ("placement:\n  - {layers: fc1..fc2, devices: [cpu:0, cpu:1], "
                 "parallel: {mode: data, bucket_mb: 0.04}}\n")
    st, plan, _ = timed(tmp_path, placement)
    buckets = [op for op in plan.ops["cpu:0"] if op.kind.value == "all_reduce"]
    assert len(buckets) == 2  # one per Linear: fc2's is ready halfway through the backward
    serial, _, _ = timed(tmp_path, placement.replace("0.04", "0.04, overlap: false"))
    assert st.step_s < serial.step_s
    assert st.step_s == pytest.approx(1e-3 + 1e-3 + 2 * 41.4e-3 + 2 * 10.1e-6)  # fc2's bucket starts at 2 ms


def test_a_pipeline_is_its_schedules_critical_path(tmp_path):
    st, plan, graph = timed(tmp_path, "placement:\n  - {layers: fc1, device: cpu:0}\n  - {layers: fc2, device: cpu:1}\n",
                            "pipeline: {microbatches: 2, schedule: gpipe}\n", hw=replace(HW, link_bw=1e12, latency=0.0))
    # per micro-batch: F 0.5 ms, B 1 ms on each stage, free sends: F0 F0' F1' ... as GPipe runs it
    # cpu:0: F0 [0, .5], F1 [.5, 1]; cpu:1: F0 [.5, 1], F1 [1, 1.5], B0 [1.5, 2.5], B1 [2.5, 3.5]
    # cpu:0: B0 [2.5, 3.5], B1 [3.5, 4.5]
    assert st.step_s == pytest.approx(4.5e-3 + 10.1e-6, rel=1e-5)  # (+ 20 ns: two sends on the path)
    timeline = pipeline_seconds(plan, graph, replace(HW, link_bw=1e12, latency=0.0))
    assert timeline.unit == "s" and timeline.makespan == pytest.approx(4.5e-3, rel=1e-5)


def accumulated(tmp_path, placement: str, n: int, hw: Hardware, extra: str = ""):
    """The model on 200 rows, `accumulate: n` micro-steps of 200 / n."""
    spec = MODEL.replace("batch_size: 50,", f"batch_size: 200, accumulate: {n},")
    path = tmp_path / f"spec{n}.yaml"
    path.write_text(spec + textwrap.dedent(placement) + extra)
    graph, plan, est, _ = build_and_plan(load_spec(str(path)))
    return step_time(plan, graph, est, hw)


OVERHEAD = replace(HW, layer_overhead=1e-4)  # 0.1 ms per layer and pass; 1 ms per message


def test_accumulate_repeats_the_fixed_costs_of_each_micro_step_and_not_its_work(tmp_path):
    placement = "placement:\n  - {layers: fc1, device: cpu:0}\n  - {layers: fc2, device: cpu:1}\n"
    one, four = (accumulated(tmp_path, placement, n, OVERHEAD) for n in (1, 4))
    # the same FLOPs and bytes in 4 micro-steps: cpu:1's fc2 forward and backward pay their
    # 0.1 ms overhead 4 times; the chain (4 layer passes, 2 copies) is serial, so each of the
    # 3 extra micro-steps adds 4 overheads and 2 messages' latency; the update runs once
    assert four.per_device["cpu:1"].compute_s - one.per_device["cpu:1"].compute_s == pytest.approx(3 * 2e-4)
    assert four.per_device["cpu:0"].step_s == pytest.approx(one.per_device["cpu:0"].step_s)
    assert four.step_s - one.step_s == pytest.approx(3 * (4e-4 + 2e-3))
    # without fixed costs, accumulating costs nothing
    flat = [accumulated(tmp_path, placement, n, replace(HW, latency=0.0)).step_s for n in (1, 4)]
    assert flat[0] == pytest.approx(flat[1])


def test_accumulate_syncs_data_parallel_gradients_once_per_step(tmp_path):
    placement = "placement:\n  - {layers: fc1..fc2, devices: [cpu:0, cpu:1], parallel: {mode: data, overlap: false}}\n"
    one, four = (accumulated(tmp_path, placement, n, OVERHEAD) for n in (1, 4))
    for d in ("cpu:0", "cpu:1"):  # one all-reduce of 80,800 B (81.8 ms) either way
        assert one.per_device[d].comm_s == pytest.approx(81.8e-3)
        assert four.per_device[d].comm_s == pytest.approx(81.8e-3)
        assert four.per_device[d].compute_s - one.per_device[d].compute_s == pytest.approx(3 * 4e-4)
    assert four.step_s - one.step_s == pytest.approx(3 * 4e-4)


def test_accumulate_refills_a_pipeline_every_micro_step(tmp_path):
    placement = "placement:\n  - {layers: fc1, device: cpu:0}\n  - {layers: fc2, device: cpu:1}\n"
    free = replace(HW, link_bw=1e12, latency=0.0)
    # micro-batches of 25 rows either way: F 0.5 ms, B 1 ms per stage. GPipe over m of them
    # ends at (m + 1) * (F + B): 8 in one pipeline 13.5 ms; 4 micro-steps of 2 fill and drain
    # the pipeline 4 times, 4 * 4.5 ms
    once = accumulated(tmp_path, placement, 1, free, "pipeline: {microbatches: 8, schedule: gpipe}\n").step_s
    four = accumulated(tmp_path, placement, 4, free, "pipeline: {microbatches: 2, schedule: gpipe}\n").step_s
    assert once == pytest.approx(13.5e-3 + 10.1e-6, rel=1e-4)
    assert four == pytest.approx(18e-3 + 10.1e-6, rel=1e-4)


def test_rates_are_interpolated_between_measured_sizes_and_held_beyond():
    hw = replace(HW, rates=((1e6, 1e9, 5e8), (1e8, 1e10, 5e9)))
    assert rate(hw, 1e5) == 1e9 and rate(hw, 1e9) == 1e10
    assert rate(hw, 1e7) == pytest.approx(10 ** 9.5)  # halfway in log size, halfway in log rate
    assert rate(hw, 1e7, backward=True) == pytest.approx(10 ** 9.5 / 2)
    assert rate(HW, 123.0) == 1e9  # no measured sizes: the peak


def test_plan_prints_and_writes_the_prediction(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(MODEL + "placement:\n  - {layers: fc1, device: cpu:0}\n  - {layers: fc2, device: cpu:1}\n")
    text = CliRunner().invoke(main, ["plan", str(spec), "--hardware", "h100", "-q"])
    assert text.exit_code == 0, text.output
    assert "predicted step time on h100 (NVIDIA H100 SXM5 data sheet)" in text.output
    out = CliRunner().invoke(main, ["plan", str(spec), "--hardware", "a100", "--format", "json", "-q"])
    doc = json.loads(out.output)["time"]
    assert doc["hardware"] == "a100" and doc["critical"] in ("cpu:0", "cpu:1")
    assert [d["device"] for d in doc["devices"]] == ["cpu:0", "cpu:1"]
    assert doc["step_s"] >= max(d["finish_s"] for d in doc["devices"]) > 0
    plain = CliRunner().invoke(main, ["plan", str(spec), "--format", "json", "-q"])
    assert "time" not in json.loads(plain.output)  # only when asked: goldens stay as they are


def test_the_cpu_profile_is_read_from_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "calibrate", lambda threads: replace(HW, name="cpu", source=f"{threads} t"))
    first = hardware.profile("cpu", workers_per_host=1)
    assert hardware.is_cached(1)
    monkeypatch.setattr(calibrate, "calibrate", lambda threads: pytest.fail("calibrated twice"))
    assert hardware.profile("cpu", workers_per_host=1) == first


CONV = """placer: 1
name: conv
model:
  layers:
    - {name: conv, op: Conv2d, args: [10, 10, 3], kwargs: {padding: 1}}
    - {name: flat, op: Flatten}
    - {name: fc, op: Linear, args: [1000, 10]}
  input: {shape: [B, 10, 10, 10]}
  target: {shape: [B, 10]}
  loss: MSELoss
devices: [cpu:0]
placement:
  - {layers: conv..fc, device: cpu:0}
training: {batch_size: 10, steps: 1, optimizer: {op: SGD, lr: 0.1}}
"""
# conv: 2 FLOPs x 10 rows x 10 channels out x 10x10 pixels x (10 channels in x 3x3) = 1.8 MFLOP forward.
# fc: 2*10*1000*10 = 0.2 MFLOP forward. flat: no FLOPs; its 40,000 B in and out = 80 us forward, 160 us back.


def test_a_convolution_runs_at_the_conv_rate_and_a_linear_at_the_linear_rate(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(CONV)
    graph, plan, est, _ = build_and_plan(load_spec(str(path)))
    assert graph.layer("conv").flops == 1_800_000 and graph.layer("fc").flops == 200_000
    linear = replace(HW, rates=((1e3, 1e9, 1e9),))  # every layer at 1 GFLOP/s both ways
    conv = replace(linear, conv_rates=((1e3, 1e8, 5e7),))  # convolutions: 0.1 forward, 0.05 backward
    flat = 80e-6 + 160e-6
    fc = 0.2e-3 + 0.4e-3
    assert step_time(plan, graph, est, linear).per_device["cpu:0"].compute_s == pytest.approx(5.4e-3 + flat + fc)
    # conv: 1.8 MFLOP at 0.1 GFLOP/s = 18 ms forward, 3.6 MFLOP at 0.05 GFLOP/s = 72 ms backward
    assert step_time(plan, graph, est, conv).per_device["cpu:0"].compute_s == pytest.approx(90e-3 + flat + fc)


def test_conv_rates_serve_convolutions_only_and_fall_back_to_the_linear_rates():
    hw = replace(HW, rates=((1e6, 1e9, 5e8),), conv_rates=((1e6, 2e8, 1e8),))
    assert rate(hw, 1e7) == 1e9 and rate(hw, 1e7, conv=True) == 2e8 and rate(hw, 1e7, True, conv=True) == 1e8
    assert rate(replace(hw, conv_rates=()), 1e7, conv=True) == 1e9


def test_a_profile_cached_by_an_older_calibration_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "calibrate", lambda threads: replace(HW, name="cpu", conv_rates=((1.0, 2.0, 3.0),)))
    first = hardware.profile("cpu", workers_per_host=1)
    path = hardware._cache_path(hardware.threads(1))
    doc = json.loads(path.read_text())
    assert hardware.profile("cpu", workers_per_host=1) == first  # read back, conv_rates as tuples
    doc["key"]["calibration"] = 1
    path.write_text(json.dumps(doc))
    monkeypatch.setattr(calibrate, "calibrate", lambda threads: replace(HW, name="cpu", source="again"))
    assert hardware.profile("cpu", workers_per_host=1).source == "again"


# ---- the plan's layers and optimizer steps timed on this machine (estimate/layertime.py) ----------

SPATIAL = """placer: 1
name: sp
model:
  layers:
    - {name: conv, op: Conv2d, args: [3, 4, 3], kwargs: {padding: 1}}
    - {name: act, op: ReLU}
  input: {shape: [B, 3, 8, 8]}
  target: {shape: [B, 4, 8, 8]}
  loss: MSELoss
devices: [cpu:0, cpu:1]
placement:
  - {layers: conv..act, devices: [cpu:0, cpu:1], parallel: {mode: spatial, dim: H}}
training: {batch_size: 4, steps: 1, optimizer: {op: Adam, lr: 0.1}}
"""


def planned(tmp_path, text):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    spec = load_spec(str(path))
    graph, plan, est, _ = build_and_plan(spec)
    return spec, graph, plan, est


def test_each_layer_is_timed_on_the_input_one_device_computes(tmp_path):
    from placer.estimate.layertime import jobs

    _, graph, plan, _ = planned(tmp_path, MODEL + "placement:\n  - {layers: fc1..fc2, devices: [cpu:0, cpu:1], "
                                "parallel: data}\n")
    assert {(j.layer, j.shape, j.trains_input) for j in jobs(plan, graph)} == {
        ("fc1", (25, 100), False), ("fc2", (25, 100), True)}  # half the 50 rows; the model's input has no grad
    _, graph, plan, _ = planned(tmp_path, SPATIAL)
    assert {j.shape for j in jobs(plan, graph)} == {(4, 3, 4, 8), (4, 4, 4, 8)}  # a band: half the rows of H


def test_measured_layer_and_step_times_replace_the_rate_model(tmp_path):
    _, graph, plan, est = planned(tmp_path, MODEL + "placement:\n  - {layers: fc1..fc2, device: cpu:0}\n")
    hw = replace(HW, layer_times={(0, "fc1"): (1.0, 2.0), (0, "fc2"): (10.0, 20.0)}, step_times={"cpu:0": 100.0})
    t = step_time(plan, graph, est, hw).per_device["cpu:0"]
    assert t.compute_s == pytest.approx(33.0) and t.step_s == pytest.approx(100.0)
    only_fc1 = replace(HW, layer_times={(0, "fc1"): (1.0, 2.0)})  # fc2 keeps its FLOPs at 1 GFLOP/s: 1 + 2 ms
    assert step_time(plan, graph, est, only_fc1).per_device["cpu:0"].compute_s == pytest.approx(3.003)
    batch = step_time(plan, graph, est, replace(hw, batch_s=7.0))  # every rank makes the batch first
    assert batch.step_s == pytest.approx(step_time(plan, graph, est, hw).step_s + 7.0)


def test_layer_timings_are_cached_and_a_layer_too_large_keeps_its_rates(tmp_path, monkeypatch):
    from placer.estimate import layertime

    spec, graph, plan, est = planned(tmp_path, SPATIAL)
    cache = tmp_path / "layers.json"
    t = layertime.measure(plan, graph, spec, 1, cache, est=est)
    assert set(t.times) == {(0, "conv"), (0, "act")} and all(f > 0 and b > 0 for f, b in t.times.values())
    assert set(t.steps) == {"cpu:0", "cpu:1"} and t.timed == 3 and not t.skipped  # one step: both hold the same
    assert t.batch_s > 0  # the synthetic batch, made each step on every rank
    monkeypatch.setattr(layertime, "_time", lambda *a: pytest.fail("timed again"))
    monkeypatch.setattr(layertime, "_time_step", lambda *a: pytest.fail("timed again"))
    again = layertime.measure(plan, graph, spec, 1, cache, est=est)
    assert again.times == t.times and again.steps == t.steps and again.timed == 0
    # another thread count is another key: timed again, here each layer as longer than its cap
    monkeypatch.undo()
    monkeypatch.setattr(layertime, "LAYER_CAP_S", -1.0)
    big = layertime.measure(plan, graph, spec, 2, cache)
    assert not big.times and [name for name, _ in big.skipped] == ["conv", "act"]
    none = layertime.measure(plan, graph, spec, 3, cache, budget_s=-1.0)
    assert not none.times and "budget" in none.skipped[0][1]
    monkeypatch.setattr(layertime, "STEP_CAP", 1)  # a step over too many parameters: the update cost serves
    capped = layertime.measure(plan, graph, spec, 4, cache, est=est)
    assert not capped.steps and [why for what, why in capped.skipped if "step" in what] == ["over 1 parameters"] * 2


def test_plan_on_the_cpu_profile_times_the_layers_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "calibrate", lambda threads: replace(HW, name="cpu"))
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPATIAL)
    out = CliRunner().invoke(main, ["plan", str(spec), "--hardware", "cpu"])
    assert out.exit_code == 0, out.output
    assert "timed 3 of the plan's layers and optimizer steps" in out.output
    assert hardware.layers_cache_path(hardware.threads(2)).exists()
    assert "to make its batch" in out.output  # measured on every plan (a few milliseconds)
    out = CliRunner().invoke(main, ["plan", str(spec), "--hardware", "cpu"])
    assert "placer: timed" not in out.output  # the second plan reads them back


def test_an_all_reduce_takes_the_measured_time_by_size_and_what_overlap_leaves_delays():
    hw = replace(HW, reduce_times=((4, 1e-3), (1004, 2e-3), (2004, 4e-3)))
    assert hardware.reduce_seconds(hw, 4) == 0.0  # the 1-float all-reduce is the fixed cost
    assert hardware.reduce_seconds(hw, 504) == pytest.approx(0.5e-3)
    assert hardware.reduce_seconds(hw, 3004) == pytest.approx(5e-3)  # past the largest: its last step's rate
    assert hardware.reduce_seconds(HW, 1000) == pytest.approx(1e-3)  # no table: the link's 1 MB/s


def test_fsdp2s_gathers_and_scatters_take_their_own_measured_times(tmp_path):
    fsdp = "placement:\n  - {layers: fc1..fc2, devices: [cpu:0, cpu:1], parallel: {mode: data, shard: full}}\n"
    table = ((4, 0.0), (1_000_004, 2.0))  # 2 s a sent MB: twice the link's time
    plain, _, _ = timed(tmp_path, fsdp)
    gathers, _, _ = timed(tmp_path, fsdp, hw=replace(HW, gather_times=table))
    scatters, _, _ = timed(tmp_path, fsdp, hw=replace(HW, scatter_times=table))
    # each device sends half of each layer's 40,400 B: 20.2 ms at the link's 1 MB/s, 40.4 ms at the table's rate;
    # fc1 and fc2 are gathered for the forward and again for the backward, and their gradients scattered once
    assert gathers.step_s - plain.step_s == pytest.approx(4 * 20.2e-3, rel=1e-3)
    assert scatters.step_s - plain.step_s == pytest.approx(2 * 20.2e-3, rel=1e-3)


def test_an_overlapped_all_reduce_that_the_cores_do_not_hide_delays_the_device(tmp_path):
    data = "placement:\n  - {layers: fc1..fc2, devices: [cpu:0, cpu:1], parallel: {mode: data, overlap: true}}\n"
    hidden, _, _ = timed(tmp_path, data)
    shown, _, _ = timed(tmp_path, data, hw=replace(HW, overlap=0.25))
    ovl = hidden.per_device["cpu:0"].overlapped_s
    assert ovl > 0 and shown.per_device["cpu:0"].comm_s == pytest.approx(0.75 * ovl)
    assert shown.per_device["cpu:0"].overlapped_s == pytest.approx(0.25 * ovl)


def test_a_halo_exchange_costs_the_programs_measured_exchange_not_a_bare_message(tmp_path):
    _, graph, plan, est = planned(tmp_path, SPATIAL)
    halos = [(s, e) for s, e, op in step_time(plan, graph, est, HW).spans["cpu:0"] if op.kind.value == "halo"]
    slow = [(s, e) for s, e, op in step_time(plan, graph, est, replace(HW, halo_s=0.5)).spans["cpu:0"]
            if op.kind.value == "halo"]
    assert len(halos) == len(slow) >= 1  # conv's halo forward (its input has no gradient to send back)
    for (s0, e0), (s1, e1) in zip(halos, slow):
        assert (e1 - s1) - (e0 - s0) == pytest.approx(0.5 - HW.latency)  # the same bytes, another fixed cost


def test_a_tensor_pairs_forward_all_reduce_carries_its_dtensor_dispatch_and_the_backwards_its_own():
    from placer.estimate.steptime import fixed_seconds
    from placer.plan.ir import Op, OpKind

    hw = replace(HW, split_s=5.0, split_grad_s=2.0)
    fwd, bwd = (Op(kind=OpKind.ALL_REDUCE, devices=("cpu:0", "cpu:1"), segment=0, phase=p, tensor=t)
                for p, t in (("fwd", "act"), ("bwd", "grad")))
    assert fixed_seconds(fwd, hw) == 5.0 and fixed_seconds(bwd, hw) == 2.0
    assert fixed_seconds(bwd, replace(hw, split_grad_s=0.0)) == 5.0  # a profile without it: split_s


def test_a_bucket_of_gradients_costs_the_measured_bucket_all_reduce(tmp_path):
    data = "placement:\n  - {layers: fc1..fc2, devices: [cpu:0, cpu:1], parallel: {mode: data, overlap: false}}\n"
    plain, _, _ = timed(tmp_path, data)
    buckets, _, _ = timed(tmp_path, data, hw=replace(HW, bucket_s=0.5))
    n = sum(1 for op in plain.spans["cpu:0"] if op[2].kind.value == "all_reduce")
    assert n >= 1 and buckets.step_s - plain.step_s == pytest.approx(n * (0.5 - HW.collective_s))


def test_fsdp2s_collectives_take_fsdp2s_measured_time_by_the_layers_size_where_calibrated(tmp_path):
    fsdp = "placement:\n  - {layers: fc1..fc2, devices: [cpu:0, cpu:1], parallel: {mode: data, shard: full}}\n"
    hw = replace(HW, sharded_times=((0, 1e-3), (80_800, 3e-3)))  # a 40,400 B layer: 2 ms each, bytes included
    st, _, _ = timed(tmp_path, fsdp, hw=hw)
    spans = [e - s for s, e, op in st.spans["cpu:0"] if op.kind.value in ("all_gather", "reduce_scatter")]
    assert len(spans) == 6 and spans == pytest.approx([2e-3] * 6)


def test_a_tensor_pairs_all_reduces_take_the_measured_time_by_size_where_calibrated():
    from placer.estimate.steptime import comm_seconds
    from placer.plan.ir import Op, OpKind

    hw = replace(HW, split_times=((0, 1.0), (1000, 3.0)), split_grad_times=((0, 0.5), (1000, 0.7)))
    fwd, bwd = (Op(kind=OpKind.ALL_REDUCE, devices=("cpu:0", "cpu:1"), segment=0, phase=p, tensor=t, bytes=500)
                for p, t in (("fwd", "act"), ("bwd", "grad")))
    assert comm_seconds(fwd, hw) == pytest.approx(2.0) and comm_seconds(bwd, hw) == pytest.approx(0.6)


def test_a_pipelines_next_micro_batch_takes_its_layers_warm_times(tmp_path):
    # GPipe, 2 micro-batches, free sends: each stage runs each layer twice in each pass; the
    # second time its weights are still in cache (the timed 4-tuple's warm half)
    _, graph, plan, est = planned(tmp_path, MODEL + "placement:\n  - {layers: fc1, device: cpu:0}\n"
                                  "  - {layers: fc2, device: cpu:1}\npipeline: {microbatches: 2, schedule: gpipe}\n")
    quick = replace(HW, link_bw=1e12, latency=0.0)
    cold = replace(quick, layer_times={(0, "fc1"): (1.0, 2.0), (1, "fc2"): (1.0, 2.0)})
    warm = replace(quick, layer_times={(0, "fc1"): (1.0, 2.0, 0.5, 1.0), (1, "fc2"): (1.0, 2.0, 0.5, 1.0)})
    assert step_time(plan, graph, est, cold).per_device["cpu:1"].compute_s == pytest.approx(6.0)  # 2 x (1 + 2)
    assert step_time(plan, graph, est, warm).per_device["cpu:1"].compute_s == pytest.approx(1 + 0.5 + 2 + 1)
    _, graph, plan, est = planned(tmp_path, MODEL + "placement:\n  - {layers: fc1..fc2, device: cpu:0}\n")
    one = step_time(plan, graph, est, replace(warm, layer_times={(0, "fc1"): (1.0, 2.0, 0.5, 1.0)}))
    assert one.per_device["cpu:0"].compute_s == pytest.approx(3.003)  # no repeat: fc1's cold pair, fc2's rates


def test_layers_are_timed_warm_too_only_where_a_step_repeats_them_and_the_workers_fit_the_cache(tmp_path, monkeypatch):
    from placer.estimate import layertime

    spec, graph, plan, est = planned(tmp_path, MODEL + "placement:\n  - {layers: fc1, device: cpu:0}\n"
                                     "  - {layers: fc2, device: cpu:1}\npipeline: {microbatches: 2, schedule: gpipe}\n")
    monkeypatch.setattr(layertime, "cache_bytes", lambda: 1 << 30)
    assert layertime.fits_cache(plan, est) == {"cpu:0": True, "cpu:1": True}
    t = layertime.measure(plan, graph, spec, 1, tmp_path / "warm.json", est=est)
    assert all(len(v) == 4 for v in t.times.values())
    total = sum(est.per_device[d].total_bytes for d in plan.devices)  # both workers share one machine's cache
    monkeypatch.setattr(layertime, "cache_bytes", lambda: total - 1)
    assert not any(layertime.fits_cache(plan, est).values())
    cold = layertime.measure(plan, graph, spec, 1, tmp_path / "cold.json", est=est)
    assert all(len(v) == 2 for v in cold.times.values())
    assert layertime.fits_cache(plan, None) == {"cpu:0": False, "cpu:1": False}  # no estimate: cold
