"""Tied parameters (an embedding and an LM head sharing one weight): found when the model is
built, counted on every device holding a copy, kept equal by one all-reduce in the plan and
the program, refused where placer cannot keep them (P080), and caught by run --check."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from placer.cli.main import main
from placer.cli.run_cmd import check_failure
from placer.codegen.program import generate
from placer.diagnostics import PlacerError
from placer.estimate.memory import memory
from placer.launch.check import compare, sensitivity_hint
from placer.model.build import build_graph, deep_check
from placer.plan.ir import OpKind
from placer.plan.lower import lower
from placer.plan.place import place
from placer.plan.text import format_plan, parse_plan
from placer.render.dot import placement_dot
from placer.spec.check import load_spec
from placer.spec.types import Optimizer

MODEL = '''
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self, vocab=32, d=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.mid(self.wte(idx))))
'''

SPEC = """placer: 1
name: tied
model:
  module: tied.py:Tied
  input: {shape: [B, 4], dtype: int64, high: 32}
  target: {shape: [B, 4], dtype: int64, high: 32}
  loss: CrossEntropyLoss
devices: [cpu:0, cpu:1, cpu:2]
placement:
PLACEMENT
training: {batch_size: 4, steps: 1, optimizer: {op: Adam, lr: 0.001}}
"""
TWO_DEVICES = """  - {name: front, layers: [wte, mid], device: cpu:0}
  - {name: back, layers: lm_head, device: cpu:1}"""
DATA_HEAD = """  - {name: front, layers: [wte, mid], device: cpu:0}
  - {name: back, layers: lm_head, devices: [cpu:1, cpu:2], parallel: data}"""
ONE_DEVICE = """  - {name: front, layers: wte, device: cpu:0}
  - {name: middle, layers: mid, device: cpu:1}
  - {name: back, layers: lm_head, device: cpu:0}"""
TIE_BYTES = 32 * 8 * 4


def spec_file(tmp_path, placement=TWO_DEVICES):
    (tmp_path / "tied.py").write_text(MODEL)
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC.replace("PLACEMENT", placement))
    return str(path)


def lowered(tmp_path, placement=TWO_DEVICES):
    spec = load_spec(spec_file(tmp_path, placement))
    graph = build_graph(spec)
    return spec, graph, lower(place(spec, graph), spec, graph)


def test_the_tie_is_found_when_the_model_is_built(tmp_path):
    graph = build_graph(load_spec(spec_file(tmp_path)))
    (tie,) = graph.ties
    assert (tie.name, tie.names, tie.layers) == ("wte.weight", ("wte.weight", "lm_head.weight"), ("wte", "lm_head"))
    assert (tie.numel, tie.bytes) == (32 * 8, TIE_BYTES)
    assert graph.layer("lm_head").params == 0 and graph.layer("lm_head").shared_params == 32 * 8


def test_each_copy_is_counted_on_its_device_and_one_all_reduce_keeps_them_equal(tmp_path):
    spec, graph, plan = lowered(tmp_path)
    mem = memory(plan, graph, Optimizer(op="Adam"))
    # the head's device holds its own copy, its gradient and Adam's two buffers for it
    assert mem["cpu:1"].params == 32 * 8 and mem["cpu:1"].optimizer_bytes == 2 * TIE_BYTES
    assert mem["cpu:0"].params == 32 * 8 + 8 * 8 + 8
    (op,) = [o for o in plan.unique_ops() if "tie" in o.attrs]
    assert (op.kind, op.devices, op.bytes, op.attrs["tie"]) == (OpKind.ALL_REDUCE, ("cpu:0", "cpu:1"), TIE_BYTES,
                                                                 "wte.weight")
    for d in ("cpu:0", "cpu:1"):  # after backward, before the device's optimizer step
        kinds = [(o.kind, o.phase) for o in plan.ops[d]]
        at = plan.ops[d].index(op)
        assert kinds[at + 1] == (OpKind.STEP, "step") and all(p != "step" for _, p in kinds[:at])
    assert parse_plan(format_plan(plan)) == plan


def test_copies_on_one_device_send_nothing(tmp_path):
    """Both ends on cpu:0 around a middle on cpu:1: the copies are summed on cpu:0."""
    _, graph, plan = lowered(tmp_path, ONE_DEVICE)
    assert not [o for o in plan.unique_ops() if "tie" in o.attrs]
    assert memory(plan, graph, Optimizer(op="SGD"))["cpu:0"].params == 2 * 32 * 8


def test_plan_lists_the_tie_in_text_json_and_the_diagram(tmp_path):
    path = spec_file(tmp_path)
    text = CliRunner().invoke(main, ["plan", "--deep", "-q", path])
    assert text.exit_code == 0, text.output
    assert "wte.weight (1.0 KiB): wte on cpu:0, lm_head on cpu:1; gradients all-reduced over cpu:0,cpu:1" in \
        text.stdout
    assert "all_reduce tied wte.weight" in text.stdout
    doc = json.loads(CliRunner().invoke(main, ["plan", "--deep", "-q", "--format", "json", path]).stdout)
    assert doc["ties"] == [{"param": "wte.weight", "numel": 256, "bytes": TIE_BYTES, "devices": ["cpu:0", "cpu:1"],
                            "copies": [{"segment": 0, "layer": "wte", "name": "wte.weight"},
                                       {"segment": 1, "layer": "lm_head", "name": "lm_head.weight"}]}]
    _, graph, plan = lowered(tmp_path)
    dot = placement_dot(plan, graph)
    assert "s0_l0 -> s1_l0 [dir=both" in dot and "tied wte.weight" in dot


def test_a_tie_placer_cannot_keep_is_refused_before_any_worker(tmp_path):
    path = spec_file(tmp_path, DATA_HEAD)
    (diag,) = [d for d in deep_check(load_spec(path)) if d.code == "P080"]
    assert "'wte.weight'" in diag.message and "'wte' (segment 'front')" in diag.message
    assert "'lm_head' (segment 'back')" in diag.message and diag.loc.line == 11
    with pytest.raises(PlacerError) as e:  # validate --deep's errors, raised before planning
        generate(load_spec(path))
    assert e.value.diagnostics[0].code == "P080"


def test_the_program_sums_the_copies_gradients(tmp_path):
    text = generate(load_spec(spec_file(tmp_path)), out_dir=str(tmp_path)).text
    assert "tie0 = dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))" in text
    assert 'tied0 = tied_copies({"wte.weight": seg0, "lm_head.weight": seg1})' in text
    assert "sum_tied_grads(list(tied0.values()), tie0)" in text
    # co-located copies: summed on the rank, no group
    text = generate(load_spec(spec_file(tmp_path, ONE_DEVICE)), out_dir=str(tmp_path)).text
    assert "tie0 =" not in text and "sum_tied_grads(list(tied0.values()))  # wte.weight" in text


def _outputs(path, losses, params, grads, tied=()):
    path.mkdir()
    (path / "metrics.json").write_text(json.dumps({"losses": losses, "tied": [list(t) for t in tied]}))
    torch.save(params, path / "final_params.pt")
    torch.save(grads, path / "first_grads.pt")


def test_check_compares_first_step_gradients_at_any_learning_rate(tmp_path):
    """A copy that missed the other copy's gradient moves by about lr a step: at lr 1e-5 its
    parameters stay within atol, its first-step gradient does not."""
    w = torch.randn(4, 4)
    g_ref, g_run = torch.randn(4, 4), torch.randn(4, 4)
    ref = {"wte.weight": w, "lm_head.weight": w}
    _outputs(tmp_path / "ref", [1.0], ref, {"wte.weight": g_ref, "lm_head.weight": g_ref},
             tied=[("wte.weight", "lm_head.weight")])
    _outputs(tmp_path / "run", [1.0], {k: v + 1e-5 for k, v in ref.items()},
             {"wte.weight": g_run, "lm_head.weight": g_ref})
    report = compare(tmp_path / "run", tmp_path / "ref")
    assert not report.ok and report.first_bad_param is None and report.first_bad_grad == "wte.weight"
    assert "the gradient of 'wte.weight' at step 1 differs" in check_failure(report)
    hint = sensitivity_hint(report, None, [])
    assert "tied parameter (wte.weight = lm_head.weight)" in hint and "Dropout" not in hint
    # relative to its own scale: a gradient off by 1e-6 of its largest element passes
    _outputs(tmp_path / "close", [1.0], ref, {"wte.weight": g_ref * (1 + 1e-6), "lm_head.weight": g_ref})
    assert compare(tmp_path / "close", tmp_path / "ref").ok
    # --rtol / --atol loosen every comparison
    assert compare(tmp_path / "run", tmp_path / "ref", rtol=10.0, atol=10.0).ok


def test_t5s_four_names_are_one_copy_per_segment(tmp_path):
    """T5: shared, encoder.embed_tokens, decoder.embed_tokens and lm_head are one parameter. The
    decoder's segment uses it under three names; in lockstep the program gives that segment one
    copy under all three (before, only decoder.embed_tokens got it and lm_head trained the
    encoder's copy unsummed)."""
    pytest.importorskip("transformers")
    from pathlib import Path

    from placer.plan.ties import placed

    spec = load_spec(str(Path(__file__).resolve().parents[1] / "models" / "hf_t5.yaml"))
    graph = build_graph(spec)
    (tie,) = graph.ties
    assert tie.name == "t5.shared.weight" and len(tie.layers) == 4
    plan = place(spec, graph)
    (t,) = placed(plan.segments, graph)
    assert t.aliases == (("t5.encoder.embed_tokens.weight",),
                         ("t5.decoder.embed_tokens.weight", "t5.lm_head.weight", "t5.shared.weight"))
    text = " ".join(generate(spec, out_dir=str(tmp_path)).text.split())
    assert ("untie(model, [['t5.decoder.embed_tokens.weight', 't5.lm_head.weight', 't5.shared.weight']])"
            in text.replace('"', "'"))
