"""What crosses a segment boundary in a module model (placer/plan/crossings.py): the trace
follows data through the parent's glue, the plan has one copy per crossing tensor and
receiving device, and placements lockstep cannot run are refused before any worker."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from placer.cli.main import main
from placer.codegen.program import generate
from placer.diagnostics import PlacerError
from placer.model.build import build_graph, deep_check
from placer.plan.ir import OpKind
from placer.plan.lower import lower
from placer.plan.place import place
from placer.plan.text import format_plan, parse_plan
from placer.spec.check import load_spec

MODELS = Path(__file__).resolve().parents[1] / "models"
LLAMA = MODELS / "hf_llama_layerwise.yaml"


def spec_file(tmp_path: Path, model: str, kwargs: str, inp: str, placement: str, extra: str = "") -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(f"""placer: 1
name: crossing
model:
  module: {MODELS / 'hf_tiny.py'}:{model}
  kwargs: {kwargs}
  input: {inp}
  target: {{shape: [B], dtype: int64, high: 8}}
  loss: CrossEntropyLoss
devices: [cpu, cpu:1]
placement:
{placement}
{extra}training: {{batch_size: 4, steps: 1, optimizer: {{op: SGD, lr: 0.1}}, seed: 0}}
""")
    return path


def lowered(path: Path):
    spec = load_spec(str(path))
    graph = build_graph(spec)
    return spec, graph, lower(place(spec, graph), spec, graph)


def crossing_copies(plan, phase: str) -> list:
    return sorted(((op.attrs["of"], op.attrs["leaf"], op.src[0], op.dst[0], op.bytes) for op in plan.unique_ops()
                   if op.kind == OpKind.COPY and op.phase == phase), key=str)


def test_llama_rotary_cos_and_sin_reach_every_decoder_layer():
    graph = build_graph(load_spec(str(LLAMA)))
    rotary = graph.layer("model.rotary_emb")
    assert rotary.out_kind == "tuple" and [leaf[2] for leaf in rotary.out_leaves] == [False, False]  # no_grad
    assert rotary.consumers == ((0, ("model.layers.0", "model.layers.1")), (1, ("model.layers.0", "model.layers.1")))
    assert graph.layer("model.layers.1").consumers == ((0, ("model.norm",)),)
    assert graph.layer("lm_head").consumers == ((0, ("output",)),)


def test_llama_layerwise_plans_one_copy_per_crossing_tensor():
    """Before: one copy of the last layer's output (8 KiB); now cos and sin cross too, and only
    the hidden state's gradient goes back (rotary runs under no_grad)."""
    _, _, plan = lowered(LLAMA)
    cos_sin = 1 * 16 * 8 * 4  # [1, seq, head_dim] float32
    assert crossing_copies(plan, "fwd") == sorted([
        ("model.layers.0", 0, "cpu", "cpu:1", 4 * 16 * 32 * 4),
        ("model.rotary_emb", 0, "cpu", "cpu:1", cos_sin), ("model.rotary_emb", 1, "cpu", "cpu:1", cos_sin)], key=str)
    assert crossing_copies(plan, "bwd") == [("model.layers.0", 0, "cpu:1", "cpu", 4 * 16 * 32 * 4)]
    assert parse_plan(format_plan(plan)) == plan


def test_a_tensor_group_beside_one_device_segments_receives_on_each_and_sends_from_its_first():
    """tests/models/tinygpt_tensor_sandwich.yaml: embed on cpu, the blocks tensor parallel over
    cpu:1 and cpu:2, the head back on cpu. The hidden state crosses to both tensor ranks and its
    gradient comes back from the first only (both hold it whole); the blocks' output crosses from
    the first, and its gradient goes to both (each runs the blocks' backward). The program reads
    its CROSSINGS and GROUPS from those ops."""
    spec, _, plan = lowered(MODELS / "tinygpt_tensor_sandwich.yaml")
    hidden = 4 * 8 * 16 * 4
    assert crossing_copies(plan, "fwd") == [("blocks.1", 0, "cpu:1", "cpu", hidden),
                                            ("embed", 0, "cpu", "cpu:1", hidden), ("embed", 0, "cpu", "cpu:2", hidden)]
    assert crossing_copies(plan, "bwd") == [("blocks.1", 0, "cpu", "cpu:1", hidden),
                                            ("blocks.1", 0, "cpu", "cpu:2", hidden), ("embed", 0, "cpu:1", "cpu", hidden)]
    assert parse_plan(format_plan(plan)) == plan
    program = generate(spec).text
    assert "GROUPS = [[1, 2]]" in program and "groups=GROUPS" in program
    assert '("embed", 0, 0, 2, "direct", False)' in program and '("embed", 0, 0, 1, "direct", True)' in program
    assert "tensor_parallelize_blocks(\n            stage,\n            g1,\n" in program


def test_a_skip_connection_crosses_only_to_devices_that_lack_it(tmp_path):
    """embed's output reaches mid (cpu:1) and, through the parent's `+ x`, head (back on cpu):
    it crosses to cpu:1 only; mid's output crosses back for head."""
    path = spec_file(tmp_path, "Skip", "{vocab: 32, d: 8}", "{shape: [B], dtype: int64, high: 32}", """\
  - {layers: embed, device: cpu}
  - {layers: mid, device: cpu:1}
  - {layers: head, device: cpu}""")
    _, graph, plan = lowered(path)
    assert graph.layer("embed").consumers == ((0, ("mid", "head")),)
    assert crossing_copies(plan, "fwd") == [("embed", 0, "cpu", "cpu:1", 4 * 8 * 4), ("mid", 0, "cpu:1", "cpu", 128)]
    assert crossing_copies(plan, "bwd") == [("embed", 0, "cpu:1", "cpu", 128), ("mid", 0, "cpu", "cpu:1", 128)]


def test_a_parents_parameter_feeding_two_devices_is_refused(tmp_path):
    path = spec_file(tmp_path, "SharedBias", "{d: 8}", "{shape: [B, 8]}", """\
  - {layers: a, device: cpu}
  - {layers: b, device: cpu:1}""")
    diags = [d for d in deep_check(load_spec(str(path))) if d.severity == "error"]
    assert [d.code for d in diags] == ["P082"] and "'bias'" in diags[0].message
    with pytest.raises(PlacerError) as e:  # validate --deep's errors, raised before planning
        generate(load_spec(str(path)))
    assert e.value.diagnostics[0].code == "P082"
    on_one = spec_file(tmp_path, "SharedBias", "{d: 8}", "{shape: [B, 8]}", """\
  - {layers: a, device: cpu}
  - {layers: b, device: cpu}""")
    assert not [d for d in deep_check(load_spec(str(on_one))) if d.severity == "error"]


def test_a_layer_returning_a_mapping_is_refused(tmp_path):
    path = spec_file(tmp_path, "DictLayer", "{d: 8}", "{shape: [B, 8]}", """\
  - {layers: pair, device: cpu}
  - {layers: head, device: cpu:1}""")
    result = CliRunner().invoke(main, ["validate", str(path), "--deep"])
    assert result.exit_code == 1 and "error[P081]: layer 'pair' (Pair)" in result.output, result.output


def looped_llama(schedule: str = "looped_bfs") -> str:
    """Llama in 4 stages on 2 ranks: a rank holds several stages."""
    text = LLAMA.read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    head, tail = text.split("placement:")
    return head + """placement:
  - {name: embed, layers: [model.embed_tokens, model.rotary_emb], device: cpu}
  - {name: first, layers: model.layers.0, device: cpu:1}
  - {name: back, layers: model.layers.1, device: cpu}
  - {name: head, layers: [model.norm, lm_head], device: cpu:1}
pipeline: {microbatches: 2, schedule: %s}
training:""" % schedule + tail.split("training:")[1]


def uneven_llama() -> str:
    """Llama whose second segment is data parallel beside a one-device first: groups of different
    sizes are not run in lockstep, so torch.distributed.pipelining cuts the model."""
    text = LLAMA.read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    return text.replace("devices: [cpu, cpu:1]", "devices: [cpu, cpu:1, cpu:2]").replace(
        "device: cpu:1}", "devices: [cpu:1, cpu:2], parallel: data}")


def test_a_rank_holding_several_stages_runs_in_lockstep(tmp_path):
    """Looped, interleaved and V schedules: each micro-batch's forward waits, in a thread of its
    own, for the action of its next stage on the rank; rotary cos / sin cross as in layer-wise."""
    path = tmp_path / "spec.yaml"
    path.write_text(looped_llama())
    assert not [d for d in deep_check(load_spec(str(path))) if d.severity == "error"]
    text = generate(load_spec(str(path)), out_dir=str(tmp_path)).text
    assert "crossing.forward_stage(stage, mb, model, xs[mb].to(device))" in text
    assert "crossing.backward_stage(stage, mb, loss)" in text and "cut_model" not in text


def test_a_pipeline_cut_that_would_pass_several_tensors_is_refused_before_the_workers(tmp_path):
    """A placement lockstep does not run is cut with torch.distributed.pipelining, which passes
    one tensor into each stage: the workers died there ("takes 3 tensors"); now validate --deep and
    generate name what crosses, and why the placement is cut."""
    path = tmp_path / "spec.yaml"
    path.write_text(uneven_llama())
    result = CliRunner().invoke(main, ["validate", str(path), "--deep"])
    assert result.exit_code == 1 and "error[P083]: segment 'back' reads tensors made in earlier segments at " \
        "model.layers.0, model.rotary_emb" in result.output, result.output
    assert "the segments' groups differ in size (1, 2 devices)" in result.output
    with pytest.raises(PlacerError) as e:  # validate --deep's errors, raised before planning
        generate(load_spec(str(path)))
    assert e.value.diagnostics[0].code == "P083"


def test_the_diagram_draws_each_crossing_tensor_from_the_layer_that_makes_it():
    from placer.render.dot import placement_dot

    _, graph, plan = lowered(LLAMA)
    dot = placement_dot(plan, graph)
    labels = [line for line in dot.splitlines() if "shape=cds" in line]
    assert len(labels) == 3 and all("cpu -> cpu:1" in x for x in labels)
    assert "copy act model.rotary_emb[1]" in dot and "fwd 8.0 KiB, bwd 8.0 KiB" in dot
    # rotary_emb is layer 1 of segment 0, model.layers.0 layer 2
    assert dot.count("  s0_l1 -> t1_") == 2 and dot.count("  s0_l2 -> t1_") == 1


def test_gpt2s_mask_made_before_the_cut_is_seen_under_a_pipeline(tmp_path):
    """GPT2Model builds its causal mask in its own forward (glue, before wpe runs) and hands it to
    every block: GPipe, 1F1B and V run in lockstep, where each rank builds the mask; cut by
    torch.distributed.pipelining (groups of different sizes), the second stage would take it too."""
    graph = build_graph(load_spec(str(MODELS / "hf_gpt2_layerwise.yaml")))
    assert graph.layer("transformer.h.1").homes == ("transformer.h.0", "transformer.wpe")
    path = tmp_path / "spec.yaml"
    text = (MODELS / "hf_gpt2_layerwise.yaml").read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    for schedule in ("gpipe", "1f1b"):  # placer's loops run it in lockstep
        path.write_text(text + f"pipeline: {{microbatches: 2, schedule: {schedule}}}\n")
        assert not [d for d in deep_check(load_spec(str(path))) if d.severity == "error"]
    head, tail = text.split("placement:")
    path.write_text(head + """placement:
  - {name: front, layers: [transformer.wte..transformer.h.0], device: cpu}
  - {name: back, layers: transformer.h.1, device: cpu:1}
  - {name: norm, layers: transformer.ln_f, device: cpu:1}
  - {name: head, layers: lm_head, device: cpu}
pipeline: {microbatches: 2, schedule: zbv_zero_bubble}
training:""" + tail.split("training:")[1])
    assert not [d for d in deep_check(load_spec(str(path))) if d.severity == "error"]  # lockstep: built on each
    path.write_text(text.replace("devices: [cpu, cpu:1]", "devices: [cpu, cpu:1, cpu:2]").replace(
        "device: cpu:1}", "devices: [cpu:1, cpu:2], parallel: data}"))  # groups of two sizes: cut
    diags = [d for d in deep_check(load_spec(str(path))) if d.severity == "error"]
    assert [d.code for d in diags] == ["P083"]
    assert "at transformer.h.0, transformer.wpe" in diags[0].message and "transformer.h.0's output" in diags[0].message


def test_training_options_in_lockstep_validate_and_are_written_into_the_program(tmp_path):
    """bf16, accumulate and recompute with a module model one device per segment (P097 retired):
    the program's lockstep step runs under autocast, once per micro-step, the recomputed
    segment's layers under checkpoint on its rank."""
    path = spec_file(tmp_path, "Skip", "{vocab: 32, d: 8}", "{shape: [B], dtype: int64, high: 32}", """\
  - {layers: embed, device: cpu}
  - {layers: [mid, head], device: cpu:1, recompute: true}""")
    text = path.read_text().replace("seed: 0}", "seed: 0, accumulate: 2, precision: bf16}")
    path.write_text(text)
    result = CliRunner().invoke(main, ["validate", "--strict", str(path)])
    assert result.exit_code == 0, result.output
    program = generate(load_spec(str(path))).text
    assert "for micro in range(2):" in program and "crossing = Lockstep(" in program
    assert program.count("with torch.autocast(device.type, dtype=torch.bfloat16):  # precision bf16") == 2
    assert "if rank == 1:\n        # recompute: segment 1's layers" in program
    assert 'recompute_layers(model, ["mid", "head"])' in program
