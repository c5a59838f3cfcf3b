"""`placer suggest` and `placement: auto`: the search's cuts, its refusals, its determinism, the spec it
writes, and plan / generate / the API resolving an auto spec. Scored on data-sheet profiles (the cases'
devices name `hardware: h100`), so nothing here calibrates this machine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

pytest.importorskip("torch")

import placer  # noqa: E402
from placer import search  # noqa: E402
from placer.cli.main import main  # noqa: E402
from placer.spec.check import load_spec, load_spec_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parents[1] / "cases" / "suggest"
MLP = CASES / "mlp_capped.yaml"


def invoke(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def test_the_cut_makes_the_costliest_range_least():
    costs = [5, 1, 1, 1, 1, 1, 4]
    total = lambda k, i, j: sum(costs[i:j])  # noqa: E731
    assert search.cut(len(costs), 2, total) == [3]  # [5 1 1] [1 1 1 4]: 7 / 7
    three = search.cut(len(costs), 3, total)
    assert three[0] == 1 and max(map(sum, (costs[:1], costs[1:three[1]], costs[three[1]:]))) == 5  # [5] ...
    # a stage that cannot hold more than two layers
    assert search.cut(len(costs), 2, lambda k, i, j: total(k, i, j) if k == 1 or j - i <= 2 else float("inf")) == [2]
    assert search.cut(3, 2, lambda k, i, j: float("inf")) is None


def test_selectors_open_a_module_model_to_the_search_depth():
    names = ("model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
    assert search.selectors(names) == ["model.embed_tokens..model.rotary_emb", "model.layers.0..model.layers.1",
                                       "model.norm", "lm_head"]
    assert search.selectors(("inp", "act", "block.0"), inline=True) == ["inp..block.0"]


def test_suggest_writes_a_spec_that_validates_within_every_capacity(tmp_path):
    out = tmp_path / "placed.yaml"
    r = invoke("suggest", MLP, "-o", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"wrote {out}: 2 devices, 2 stages")
    text = out.read_text()
    assert text.startswith("# yaml-language-server: $schema=")  # the modeline stays first,
    schema = text.splitlines()[0].split("$schema=")[1]  # the schema named from the output's folder
    assert (tmp_path / schema).resolve() == (ROOT / "placer" / "schemas" / "placer-spec.schema.json").resolve()
    assert "# placement suggested by `placer suggest` (hardware h100):" in text
    assert "#   predicted step time" in text and "#   next best:" in text
    assert "#     cpu: " in text and " / 3.0 MiB" in text
    assert "# An MLP whose plain data parallelism" in text  # the user's comments are kept
    spec = load_spec(str(out))
    assert not spec.auto and len(spec.placement) == 2
    # plain data parallelism would hold about 4 MiB per device: not what it chose
    assert all(s.mode != "data" or s.parallel.shard != "none" for s in spec.placement)
    found = placer.suggest(str(MLP))
    assert all(b <= 3 * 2**20 for b in found.best.memory.values())
    assert all(b <= 3 * 2**20 for c in found.kept for b in c.memory.values())
    r = invoke("validate", "--strict", out)
    assert r.exit_code == 0, r.output


def test_the_search_is_deterministic():
    spec = load_spec(str(MLP))
    first, again = search.suggest(spec, "h100"), search.suggest(spec, "h100")
    assert first.text == again.text
    assert [c.as_dict() for c in first.kept] == [c.as_dict() for c in again.kept]


def test_json_lists_every_kept_candidate_fastest_first():
    r = invoke("suggest", MLP, "--format", "json", "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["format"] == "placer-suggest/1" and doc["capacities"] == {"cpu": 3 * 2**20, "cpu:1": 3 * 2**20}
    times = [c["step_s"] for c in doc["candidates"]]
    assert len(times) > 3 and times == sorted(times)
    assert doc["pruned"] >= 1  # plain data parallelism, over the cap
    assert set(doc["candidates"][0]) == {"step_s", "critical", "bound", "pipeline", "memory", "stages"}


def test_nothing_fits_is_a001_naming_the_smallest_shortfall():
    r = invoke("suggest", MLP, "--hardware", "h100", "--set", "devices=[{name: cpu, memory: 1MiB}, {name: cpu:1, memory: 1MiB}]")
    assert r.exit_code == 1
    line = r.stderr.splitlines()[-2]
    assert "error[A001]: no placement fits the stated memory: the closest (" in line
    assert "over its 1.0 MiB" in line
    assert "hint: give cpu at least" in r.output and "list more devices" in r.output
    assert "Traceback" not in r.output


def test_an_unlimited_device_beside_a_capped_one_takes_the_model():
    """A device that states no memory has no limit (not none). The unlimited one is listed first: the
    first CPU worker also builds the whole model from the seed at set-up (the estimate's setup_bytes),
    about 1.1 MiB here, so a first device capped at 1 MiB could hold no plan at all."""
    spec = load_spec(str(MLP))
    text = MLP.read_text().replace("{name: cpu, memory: 3MiB, hardware: h100}", "{name: cpu, hardware: h100}")
    text = text.replace("memory: 3MiB", "memory: 1MiB")
    found = search.suggest(load_spec_text(text, spec.file), "h100")
    assert found.best.memory.get("cpu:1", 0) <= 2**20
    assert all(c.memory.get("cpu:1", 0) <= 2**20 for c in found.kept)


def test_each_device_is_scored_on_its_own_hardware():
    """The same plan predicts a slower step when one of its devices is a V100 beside an H100."""
    from placer.cli.plan_cmd import build_and_plan
    from placer.estimate.hardware import profile
    from placer.estimate.steptime import step_time

    spec = load_spec(str(CASES.parent / ".." / ".." / "specs" / "mlp_pipeline_1f1b.yaml"))
    graph, plan, est, _ = build_and_plan(spec)
    fast = step_time(plan, graph, est, profile("h100"))
    mixed = step_time(plan, graph, est, profile("h100"), {"cuda:1": profile("v100")})
    assert mixed.per_device["cuda:1"].compute_s > fast.per_device["cuda:1"].compute_s
    assert mixed.per_device["cuda:0"].compute_s == fast.per_device["cuda:0"].compute_s


def test_placement_auto_through_plan_generate_and_the_api(tmp_path):
    spec = yaml.safe_load(MLP.read_text())
    assert spec["placement"] == "auto"
    r = invoke("plan", MLP, "--hardware", "h100")
    assert r.exit_code == 0, r.output
    assert "placer: placement auto: chose 2 devices, 2 stages" in r.stderr
    assert r.stdout.startswith("plan capped_mlp:") and "2 segments on 2 devices" in r.stdout
    prog = tmp_path / "prog.py"
    r = invoke("generate", MLP, "-o", prog)
    assert r.exit_code == 0, r.output
    assert "placement auto: chose" in r.stderr and prog.exists()
    report = placer.plan(str(MLP))
    assert len(report.plan.segments) == 2
    written = search.suggest(load_spec(str(MLP)), "h100").spec
    assert [s.selectors for s in report.spec.placement] == [s.selectors for s in written.placement]


@pytest.mark.parametrize("case", ["tinygpt_auto.yaml", "hf_llama_auto.yaml"])
def test_module_models_get_a_placement_that_validates_deep(case, tmp_path):
    pytest.importorskip("transformers") if case.startswith("hf_") else None
    r = invoke("validate", "--deep", CASES / case)  # the auto spec itself: its model builds, its loss runs
    assert r.exit_code == 0 and "placement auto" in r.output, r.output
    out = tmp_path / "placed.yaml"
    r = invoke("suggest", CASES / case, "-o", out)
    assert r.exit_code == 0, r.output
    assert "module: " in out.read_text()  # relocated to the output's folder
    r = invoke("validate", "--deep", out)
    assert r.exit_code == 0, r.output
    assert "2 segments" in r.output


def test_stages_on_a_slower_device_get_fewer_layers():
    """The cut weighs each layer at its stage's own hardware: an H100 beside an L4 takes more layers."""
    from placer.search import space

    layers = "".join(f"    - {{name: l{i}, op: Linear, args: [2048, 2048]}}\n" for i in range(8))
    text = (f"placer: 1\nname: mixed\nmodel:\n  layers:\n{layers}  input: {{shape: [B, 2048]}}\n"
            "  target: {shape: [B, 2048]}\n  loss: MSELoss\n"
            "devices: [{name: cuda:0, hardware: h100}, {name: cuda:1, hardware: l4}]\n"
            "training: {batch_size: 256, steps: 1, optimizer: {op: SGD, lr: 0.1}}\n")
    spec = load_spec_text(text)
    graph = space.model_graph(spec)
    hw = search._profiles(search._hardware(spec, "cpu"), 2)
    two = [c for c in space.candidates(spec, graph, {"cuda:0": "h100", "cuda:1": "l4"}, hw, {})
           if len(c.stages) == 2 and not c.schedule]
    # a layer: 0.22 ms on the H100, 0.41 on the L4 (FP32 data sheets): 5 + 3 (1.10 / 1.24 ms), not 4 + 4
    assert [len(s.layers) for s in two[0].stages] == [5, 3]


def test_cluster_outputs_take_a_written_placement(tmp_path):
    r = invoke("generate", MLP, "--sbatch", tmp_path / "job.sbatch")
    assert r.exit_code == 2 and "--sbatch and --k8s take a written placement" in r.output


def test_a_multi_node_run_takes_a_written_placement(tmp_path):
    r = invoke("run", MLP, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "localhost:29500",
               "--run-dir", tmp_path / "run")
    assert r.exit_code == 1 and "error[A003]: placement auto with --nnodes 2" in r.output, r.output
