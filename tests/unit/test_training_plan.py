"""What the training options change in the plan and the program: accumulate's micro-steps
(activations of one micro-step, per-micro-step gathers N times), clip_grad_norm's 4-byte
all-reduce, lr_schedule's scheduler, and their diagnostics."""
from __future__ import annotations

from pathlib import Path

import pytest

from placer import api
from placer.diagnostics import SpecError
from placer.plan.ir import OpKind
from placer.plan.text import format_plan, parse_plan
from placer.spec import load
from placer.spec.check import validate_document

ROOT = Path(__file__).resolve().parents[2]
FSDP = str(ROOT / "specs" / "mlp_data_shard_full.yaml")
LAYERWISE = str(ROOT / "specs" / "mlp_layerwise_direct.yaml")


def _ops(report, kind, tensor):
    return [op for op in report.plan.unique_ops() if op.kind == kind and op.tensor == tensor]


def test_accumulate_keeps_one_micro_steps_activations_and_gathers_per_micro_step():
    one, two = api.plan(FSDP), api.plan(FSDP, ["training.accumulate=2"])
    for d in one.plan.devices:
        a1, a2 = one.estimate.per_device[d].activation_bytes, two.estimate.per_device[d].activation_bytes
        assert a1 > 0 and a2 == a1 // 2
    # FSDP2 gathers each layer's parameters in every micro-step; reduce-scatters once, after the last
    for kind, tensor, times in ((OpKind.ALL_GATHER, "params", 2), (OpKind.REDUCE_SCATTER, "grads", 1)):
        b1 = [op.bytes for op in _ops(one, kind, tensor)]
        b2 = [op.bytes for op in _ops(two, kind, tensor)]
        assert b1 and b2 == [b * times for b in b1]
    assert two.plan.accumulate == 2 and parse_plan(format_plan(two.plan)) == two.plan
    assert "accumulate" not in format_plan(one.plan).splitlines()[0]  # plans without it read as before


def test_clip_grad_norm_all_reduces_4_bytes_over_every_device_before_the_steps():
    report = api.plan(LAYERWISE, ["training.clip_grad_norm=1.0"])
    (op,) = _ops(report, OpKind.ALL_REDUCE, "grad_norm")
    assert op.bytes == 4 and op.devices == report.plan.devices
    for d in report.plan.devices:
        kinds = [o.kind for o in report.plan.ops[d]]
        first_step = kinds.index(OpKind.STEP)
        assert report.plan.ops[d].index(op) < first_step
    assert not _ops(api.plan(LAYERWISE), OpKind.ALL_REDUCE, "grad_norm")
    assert parse_plan(format_plan(report.plan)) == report.plan


def test_the_program_writes_the_options_plainly(tmp_path):
    text = api.generate(LAYERWISE, overrides=[
        "training.lr_schedule={op: StepLR, kwargs: {step_size: 2, gamma: 0.5}}", "training.clip_grad_norm=0.5",
        "training.accumulate=2"])
    assert "return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)" in text
    assert "CLIP_GRAD_NORM = 0.5" in text and "ACCUMULATE = 2" in text
    assert "grad_norm = clip_global_grad_norm(" in text and "scheduler.step()" in text
    assert "for micro in range(2):" in text
    assert "gradient_sync(" not in text  # layer-wise: nothing syncs in backward
    plain = api.generate(LAYERWISE)
    assert "clip_global_grad_norm" not in plain and "micro_losses" not in plain and "schedulers" not in plain


def test_a_scheduler_that_rejects_its_kwargs_is_located(tmp_path):
    with pytest.raises(SpecError) as e:
        api.generate(LAYERWISE, overrides=["training.lr_schedule={op: StepLR, kwargs: {step: 2}}"])
    d = e.value.diagnostics[0]
    assert d.code == "G006" and "StepLR" in d.message and "step_size" in d.hint


SPEC = """\
placer: 1
name: t
model:
  layers:
    - {name: fc1, op: Linear, args: [8, 8]}
    - {name: fc2, op: Linear, args: [8, 2]}
  input: {shape: [B, 8]}
  target: {shape: [B], dtype: int64, high: 2}
  loss: CrossEntropyLoss
devices: [cpu:0, cpu:1]
placement:
  - {layers: fc1, devices: [cpu:0, cpu:1], parallel: PARALLEL}
  - {layers: fc2, device: cpu:1}
training:
  batch_size: 12
  steps: 2
  optimizer: {op: SGD, lr: 0.1}
EXTRA
"""


@pytest.mark.parametrize("parallel, extra, code, words", [
    ("data", "  accumulate: 5", "P094", "batch_size 12 is not divisible by accumulate 5"),
    ("data", "  accumulate: 4", "P030", "batch_size 12 / accumulate 4 = 3 is not divisible by the 2 devices"),
    ("data", "  accumulate: 2\npipeline: {microbatches: 4, schedule: gpipe}", "P041",
     "batch_size 12 / accumulate 2 = 6 is not divisible by microbatches 4"),
    ("{mode: data, sync: broadcast}", "  clip_grad_norm: 1.0", "P092", "sync 'broadcast' steps as it syncs"),
    ("data", "  lr_schedule: {op: ReduceLROnPlateau}", "P091", "steps on a validation metric"),
])
def test_training_diagnostics(parallel, extra, code, words):
    doc = load.load_text(SPEC.replace("PARALLEL", parallel).replace("EXTRA", extra), "<spec>")
    diags = [d for d in validate_document(doc)[1] if d.code == code]
    assert len(diags) == 1 and diags[0].severity == "error", diags
    assert words in diags[0].message + " " + (diags[0].hint or ""), diags[0]


@pytest.mark.parametrize("spec, kind, fwd, bwd", [
    ("mlp_tensor", OpKind.ALL_REDUCE, 2, 1),  # the pairs' sums and the column halves' input gradients
    ("cnn_channel", OpKind.ALL_GATHER, 2, 1),  # slices after a Conv, and the partial input gradients summed
])
def test_bf16_collectives_move_what_autocast_makes(spec, kind, fwd, bwd):
    """Under autocast a Linear / Conv output is bfloat16, and so is what the split layers after
    it exchange: those collectives halve; the gradient all-reduces of parameters do not."""
    path = str(ROOT / "specs" / f"{spec}.yaml")
    plain, half = api.plan(path), api.plan(path, ["training.precision=bf16"])
    pairs = list(zip(plain.plan.unique_ops(), half.plan.unique_ops()))
    assert all(a.with_(bytes=0) == b.with_(bytes=0) for a, b in pairs)
    halved = [(a.phase, a.kind) for a, b in pairs if b.bytes * 2 == a.bytes != 0]
    assert halved.count(("fwd", kind)) == fwd and halved.count(("bwd", OpKind.ALL_REDUCE)) == bwd, halved
    assert all(a.bytes == b.bytes for a, b in pairs if a.tensor in ("grads", "params") or a.attrs.get("bucket") is not None)


def test_bf16_halves_the_activations():
    plain, bf16 = api.plan(LAYERWISE), api.plan(LAYERWISE, ["training.precision=bf16"])
    for d in plain.plan.devices:
        assert bf16.estimate.per_device[d].activation_bytes == plain.estimate.per_device[d].activation_bytes // 2 > 0
    assert parse_plan(format_plan(bf16.plan)) == bf16.plan and "precision=" in format_plan(bf16.plan)
    assert "autocast" in api.generate(LAYERWISE, overrides=["training.precision=bf16"])


def test_recompute_keeps_the_segment_input_and_adds_a_forward():
    spec = str(ROOT / "specs" / "mlp_pipeline_1f1b.yaml")
    plain, again = api.plan(spec), api.plan(spec, ["placement.0.recompute=true"])
    d0, d1 = again.plan.devices
    assert again.estimate.per_device[d0].activation_bytes < plain.estimate.per_device[d0].activation_bytes
    assert again.estimate.per_device[d1].activation_bytes == plain.estimate.per_device[d1].activation_bytes
    f0, f1 = plain.estimate.per_device[d0].flops, again.estimate.per_device[d0].flops
    assert f1 * 3 == f0 * 4  # forward + backward (2x) + the forward again
    assert again.plan.segments[0].recompute and parse_plan(format_plan(again.plan)) == again.plan
    assert "recompute" not in format_plan(plain.plan)


@pytest.mark.parametrize("parallel, words", [
    ("{mode: data, shard: full}", "FSDP2 gathers the parameters in its forward"),
    ("{mode: data, sync_batchnorm: true}", "SyncBatchNorm all-reduces statistics"),
])
def test_recompute_of_a_segment_that_gathers_or_keeps_statistics_is_refused(parallel, words):
    doc = load.load_text(SPEC.replace("PARALLEL", parallel).replace("EXTRA", "").replace(
        f"parallel: {parallel}}}", f"parallel: {parallel}, recompute: true}}"), "<spec>")
    (d,) = [d for d in validate_document(doc)[1] if d.code == "P096"]
    assert words in d.message


@pytest.mark.parametrize("spec", ["mlp_tensor", "cnn_channel", "cnn_spatial"])
def test_recompute_runs_the_forward_collectives_again_in_backward(spec):
    """A recomputed segment whose forward communicates: checkpoint runs the forward, and so
    its all-reduces / all-gathers / halo exchanges, again at the start of its backward."""
    path = str(ROOT / "specs" / f"{spec}.yaml")
    plain, again = api.plan(path), api.plan(path, ["placement.0.recompute=true"])
    fwd = [o for o in plain.plan.unique_ops() if o.segment == 0 and o.phase == "fwd" and o.kind != OpKind.COMPUTE
           and o.kind not in (OpKind.COPY, OpKind.SPLIT, OpKind.MERGE, OpKind.RESPLIT)]
    redo = [o for o in again.plan.unique_ops() if o.attrs.get("recompute")]
    assert fwd and [(o.kind, o.bytes) for o in redo] == [(o.kind, o.bytes) for o in fwd]
    assert all(o.phase == "bwd" for o in redo)
    assert len(again.plan.unique_ops()) == len(plain.plan.unique_ops()) + len(fwd)
    assert parse_plan(format_plan(again.plan)) == again.plan
