"""Module models whose segments are data parallel over groups of one size run in lockstep as
replica pipelines (placer/plan/crossings.py): the plan sends each crossing within its pipeline
(the r-th device of every segment) on that pipeline's share of the batch, all-reduces each
group's gradients, and sums a tie over every copy; what lockstep cannot run says why (P083)."""
from __future__ import annotations

from pathlib import Path

from placer.codegen.program import generate
from placer.model.build import build_graph, deep_check
from placer.plan.ir import OpKind
from placer.plan.lower import lower
from placer.plan.place import place
from placer.spec.check import load_spec

MODELS = Path(__file__).resolve().parents[1] / "models"
PLACEMENT = """devices: [cpu, cpu:1, cpu:2, cpu:3]
placement:
  - {{name: front, layers: [{}], devices: [cpu, cpu:1], parallel: {}}}
  - {{name: back, layers: [{}], devices: [{}], parallel: data}}
{}training:"""
GPT2 = ("hf_gpt2_layerwise", "transformer.wte..transformer.h.0", "transformer.h.1, transformer.ln_f, lm_head")
LLAMA = ("hf_llama_layerwise", "model.embed_tokens, model.rotary_emb, model.layers.0",
         "model.layers.1, model.norm, lm_head")


def spec_file(tmp_path: Path, model, front="data", back="cpu:2, cpu:3", pipeline="", tied=False) -> Path:
    base, first, last = model
    text = (MODELS / f"{base}.yaml").read_text().replace("hf_tiny.py", str(MODELS / "hf_tiny.py"))
    head, tail = text.split("\ndevices:", 1)
    text = head + "\n" + PLACEMENT.format(first, front, last, back, pipeline) + tail.split("\ntraining:", 1)[1]
    if tied:
        text = text.replace("n_heads: 2}", "n_heads: 2, tied: true}", 1)
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def lowered(path: Path):
    spec = load_spec(str(path))
    graph = build_graph(spec)
    return spec, graph, lower(place(spec, graph), spec, graph)


def test_llamas_crossings_stay_in_their_replica_pipeline(tmp_path):
    """Batch 4 over 2 replicas: the hidden state carries 2 rows; rotary cos / sin ([1, seq, 8])
    are the same for every row, so each pipeline sends them whole."""
    _, _, plan = lowered(spec_file(tmp_path, LLAMA))
    copies = sorted((op.attrs["of"], op.attrs["leaf"], op.src[0], op.dst[0], op.bytes) for op in plan.unique_ops()
                    if op.kind == OpKind.COPY and op.phase == "fwd")
    hidden, cos_sin = 2 * 16 * 32 * 4, 1 * 16 * 8 * 4
    assert copies == sorted(
        [(layer, leaf, a, b, n) for a, b in (("cpu", "cpu:2"), ("cpu:1", "cpu:3"))
         for layer, leaf, n in (("model.layers.0", 0, hidden), ("model.rotary_emb", 0, cos_sin),
                                ("model.rotary_emb", 1, cos_sin))])
    grads = {(op.src[0], op.dst[0]) for op in plan.unique_ops() if op.kind == OpKind.COPY and op.phase == "bwd"}
    assert grads == {("cpu:2", "cpu"), ("cpu:3", "cpu:1")}
    groups = {op.devices for op in plan.unique_ops() if op.kind == OpKind.ALL_REDUCE}
    assert groups == {("cpu", "cpu:1"), ("cpu:2", "cpu:3")}


def test_a_tie_across_replica_pipelines_is_summed_over_every_copy(tmp_path):
    """GPT-2's wte / lm_head under GPipe: one all-reduce over the four copies; the front group's
    all-reduce leaves the tie out (else wte's gradient would be counted twice)."""
    spec, graph, plan = lowered(spec_file(tmp_path, GPT2, pipeline="pipeline: {microbatches: 2, schedule: gpipe}\n",
                                          tied=True))
    assert not [d for d in deep_check(spec) if d.severity == "error"]  # no P080, no P083
    ops = plan.unique_ops()
    (tie,) = [op for op in ops if "tie" in op.attrs]
    assert tie.devices == ("cpu", "cpu:1", "cpu:2", "cpu:3") and tie.bytes == 128 * 32 * 4
    front = sum(graph.layer(n).param_bytes for n in plan.segments[0].layers)
    grads = {op.devices: 0 for op in ops if op.kind == OpKind.ALL_REDUCE and "tie" not in op.attrs}
    for op in ops:
        if op.devices in grads and op.kind == OpKind.ALL_REDUCE:
            grads[op.devices] += op.bytes
    assert grads[("cpu", "cpu:1")] == front - tie.bytes
    sends = {(op.src[0], op.dst[0], op.microbatch, op.bytes) for op in ops if op.kind == OpKind.SEND}
    hidden = 1 * 16 * 32 * 4  # batch 4: 2 rows a replica, 1 a micro-batch
    assert sends == {(a, b, mb, hidden) for mb in (0, 1) for a, b in (("cpu", "cpu:2"), ("cpu:1", "cpu:3"),
                                                                      ("cpu:2", "cpu"), ("cpu:3", "cpu:1"))}


def test_the_program_runs_each_pipeline_on_its_rows(tmp_path):
    spec = load_spec(str(spec_file(tmp_path, GPT2, pipeline="pipeline: {microbatches: 2, schedule: 1f1b}\n",
                                   tied=True)))
    text = generate(spec, out_dir=str(tmp_path)).text
    assert "PIPELINES = [[0, 2], [1, 3]]" in text
    assert "local_slice(x, PIPELINES, crossing.segments)" in text and "for action in order:" in text
    assert "tie0 = dist.new_group([0, 1, 2, 3]" in text
    assert "all_reduce_grads(untied(seg0.parameters(), tied0), g0, bucket_mb=25.0)" in text
    assert "ddp_sum(" not in text


def test_what_lockstep_cannot_run_says_why(tmp_path):
    """Cut by torch.distributed.pipelining instead, which passes one tensor: P083 names the reason."""
    cases = {
        "groups differ in size (2, 4 devices)": dict(back="cpu, cpu:1, cpu:2, cpu:3"),
        "device 'cpu:1' is number 2 of one group and number 1 of segment 'back'": dict(back="cpu:1, cpu"),
    }
    for why, kw in cases.items():
        spec = load_spec(str(spec_file(tmp_path, LLAMA, **kw)))
        diags = [d for d in deep_check(spec) if d.code == "P083"]
        assert len(diags) == 1 and why in diags[0].message, (why, [d.message for d in deep_check(spec)])
