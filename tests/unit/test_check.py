"""Semantic checks (placer.spec.check) on small specs built as dicts."""
from __future__ import annotations

import copy

import pytest
import yaml

from placer.diagnostics import Diagnostic, Loc, SpecError, closest, did_you_mean, format_report, name_hint
from placer.spec import check, select
from placer.spec.load import load_text

BASE = {
    "placer": 1,
    "name": "t",
    "model": {
        "layers": [
            {"name": "inp", "op": "Linear", "args": [8, 16]},
            {"name": "act", "op": "ReLU"},
            {"name": "block", "op": "Linear", "args": [16, 16], "repeat": 4},
            {"name": "head", "op": "Linear", "args": [16, 2]},
        ],
        "input": {"shape": ["B", 8]},
        "target": {"shape": ["B"], "dtype": "int64", "high": 2},
        "loss": "CrossEntropyLoss",
    },
    "devices": ["cuda:0"],
    "placement": [{"layers": "inp..head", "device": "cuda:0"}],
    "training": {"batch_size": 8, "steps": 1, "optimizer": {"op": "SGD", "lr": 0.1}},
}
NAMES = ["inp", "act", "block.0", "block.1", "block.2", "block.3", "head"]


def spec_with(**changes) -> dict:
    d = copy.deepcopy(BASE)
    for key, value in changes.items():
        d[key] = value
    return d


def run(d: dict):
    text = yaml.safe_dump(d, sort_keys=False)
    spec, diags = check.validate_document(load_text(text, "spec.yaml"))
    return spec, diags


def codes(d: dict, severity: str | None = None) -> list[str]:
    return [x.code for x in run(d)[1] if severity is None or x.severity == severity]


def segs(*entries) -> list[dict]:
    return [dict(e) for e in entries]


# --- selectors


@pytest.mark.parametrize("text, want", [
    ("block", [2, 3, 4, 5]),            # a name selects its subtree: block = block.*
    ("block.*", [2, 3, 4, 5]),
    ("block.1", [3]),
    ("block.1..head", [3, 4, 5, 6]),
    ("act..block", [1, 2, 3, 4, 5]),     # a subtree as a range end: its last layer
    ("block..block", [2, 3, 4, 5]),
    ("block.[02]", [2, 4]),
    ("*", list(range(7))),
])
def test_selector_matches(text, want):
    assert select.match(text, NAMES) == want


@pytest.mark.parametrize("text", ["bl", "block.", "blockx", "block.4", "head..inp", "nope..head", "x*"])
def test_selector_misses_are_messages(text):
    assert isinstance(select.match(text, NAMES), str)


def test_a_name_does_not_select_a_longer_name():
    assert select.match("fc1", ["fc1", "fc10", "fc1.a"]) == [0, 2]


def test_resolve_segments_gives_layer_indices_per_segment():
    d = spec_with(devices=["cuda:0", "cuda:1"], placement=segs({"layers": ["inp", "act"], "device": "cuda:0"},
                                 {"layers": "block", "device": "cuda:1"},
                                 {"layers": "head", "device": "cuda:0"}))
    spec, diags = run(d)
    assert diags == []
    groups, more = check.resolve_segments(spec, check.layer_names(spec))
    assert groups == [[0, 1], [2, 3, 4, 5], [6]] and more == []


def test_selector_hints():
    d = spec_with(devices=["cuda:0", "cuda:1"],
                  placement=segs({"layers": ["inp", "act", "blocks.*"], "device": "cuda:0"},
                                 {"layers": "hed", "device": "cuda:1"}))
    diags = run(d)[1]
    assert [x.code for x in diags] == ["P001", "P001"]
    assert diags[0].hint == "did you mean 'block.*'?"
    assert "did you mean 'head'?" in diags[1].hint


def test_layer_in_two_selectors_of_one_segment():
    d = spec_with(placement=segs({"layers": ["inp..act", "act..head"], "device": "cuda:0"}))
    diags = run(d)[1]
    assert diags[0].code == "P002" and "twice in segment 's0'" in diags[0].message


# --- devices


def test_unprefixed_device_is_node0():
    assert "P010" in codes(spec_with(devices=["cuda:0", "node0/cuda:0"]))
    assert "P010" not in codes(spec_with(devices=["cuda:0", "node1/cuda:0"]))


def test_unused_device_is_a_warning():
    assert codes(spec_with(devices=["cuda:0", "cuda:1"])) == ["W001"]
    assert codes(spec_with(devices=["cuda:0"])) == []


def test_parameter_server_outside_the_group_counts_as_used():
    d = spec_with(devices=["cpu", "cuda:0", "cuda:1"], placement=segs(
        {"layers": "inp..head", "devices": ["cuda:0", "cuda:1"],
         "parallel": {"mode": "data", "sync": "parameter_server", "server": "cpu"}}))
    assert codes(d) == []


# --- modes


def channel_model(norm: dict) -> dict:
    return spec_with(
        model={**BASE["model"], "layers": [
            {"name": "conv", "op": "Conv2d", "args": [3, 4, 3], "kwargs": {"padding": 1}},
            norm,
            {"name": "flat", "op": "Flatten"},
            {"name": "head", "op": "Linear", "args": [256, 2]}],
            "input": {"shape": ["B", 3, 8, 8]}},
        devices=["cuda:0", "cuda:1"],
        placement=segs({"layers": "conv..norm", "devices": ["cuda:0", "cuda:1"], "parallel": "channel"},
                       {"layers": "flat..head", "device": "cuda:0"}))


@pytest.mark.parametrize("norm, ok", [
    ({"name": "norm", "op": "BatchNorm2d", "args": [4]}, True),
    ({"name": "norm", "op": "InstanceNorm2d", "args": [4]}, True),
    ({"name": "norm", "op": "GroupNorm", "args": [2, 4]}, False),
    ({"name": "norm", "op": "LayerNorm", "args": [[4, 8, 8]]}, False),
])
def test_channel_accepts_per_channel_norms_only(norm, ok):
    assert codes(channel_model(norm)) == ([] if ok else ["P027"])


def spatial_model(dim, h=16, w=16) -> dict:
    return spec_with(
        model={**BASE["model"], "layers": [
            {"name": "conv", "op": "Conv2d", "args": [3, 4, 3], "kwargs": {"padding": 1}},
            {"name": "pool", "op": "MaxPool2d", "args": [2]},
            {"name": "flat", "op": "Flatten"},
            {"name": "head", "op": "Linear", "args": [4 * (h // 2) * (w // 2), 2]}],
            "input": {"shape": ["B", 3, h, w]}},
        devices=["cuda:0", "cuda:1"], placement=segs({"layers": "conv..pool", "devices": ["cuda:0", "cuda:1"],
                        "parallel": {"mode": "spatial", "dim": dim}},
                       {"layers": "flat..head", "device": "cuda:0"}))


@pytest.mark.parametrize("dim, h, w, want", [
    ("H", 16, 16, []), ("W", 16, 16, []), (2, 16, 16, []), (3, 16, 16, []), (-1, 16, 16, []), (-2, 16, 16, []),
    (1, 16, 16, ["P029"]),          # the channel dim
    (-3, 16, 16, ["P029"]),
    ("H", 6, 16, ["P029"]),         # 3 rows per device cannot feed a stride-2 pool
    ("W", 16, 6, ["P029"]), (-1, 16, 6, ["P029"]), (-2, 16, 6, []),
])
def test_spatial_split_dims(dim, h, w, want):
    assert codes(spatial_model(dim, h, w)) == want


@pytest.mark.parametrize("layers, ok", [
    ([("Linear", [16, 32]), ("ReLU", None), ("Linear", [32, 16])], True),
    ([("Linear", [16, 32]), ("Linear", [32, 16]), ("Linear", [16, 32]), ("GELU", None), ("Linear", [32, 16])], True),
    ([("Linear", [16, 16])], False),
    ([("Linear", [16, 16]), ("LayerNorm", [16]), ("Linear", [16, 16])], False),
    # the issue-10 segment: the plan and the program pair (0, 2) and (3, 5) by one rule
    ([("Linear", [16, 32]), ("Tanhshrink", None), ("Linear", [32, 16]), ("Linear", [16, 32]), ("Dropout", [0.0]),
      ("Linear", [32, 16])], True),
    ([("Linear", [16, 32]), ("Linear", [32, 16]), ("Linear", [16, 16])], False),  # a Linear left alone
])
def test_tensor_needs_linear_pairs(layers, ok):
    model = {**BASE["model"], "layers": [{"name": "inp", "op": "Linear", "args": [8, 16]}]
             + [{"name": f"l{i}", "op": op, **({"args": a} if a else {})} for i, (op, a) in enumerate(layers)]
             + [{"name": "head", "op": "Linear", "args": [16, 2]}]}
    d = spec_with(model=model, devices=["cuda:0", "cuda:1"], placement=segs(
        {"layers": "inp", "device": "cuda:0"},
        {"layers": f"l0..l{len(layers) - 1}", "devices": ["cuda:0", "cuda:1"], "parallel": "tensor"},
        {"layers": "head", "device": "cuda:0"}))
    assert codes(d) == ([] if ok else ["P028"])


def test_sync_batchnorm_without_batchnorm_warns():
    d = spec_with(devices=["cuda:0", "cuda:1"],
                  placement=segs({"layers": "inp..head", "devices": ["cuda:0", "cuda:1"],
                                  "parallel": {"mode": "data", "sync_batchnorm": True}}))
    assert codes(d) == ["W002"]


def test_batchnorm_warns_where_its_statistics_differ_from_one_device():
    layers = BASE["model"]["layers"]
    model = {**BASE["model"], "layers": layers[:1] + [{"name": "bn", "op": "BatchNorm1d", "args": [layers[0]["args"][1]]}]
             + layers[1:]}
    data = {"layers": "inp..head", "devices": ["cuda:0", "cuda:1"], "parallel": "data"}
    assert codes(spec_with(model=model, devices=["cuda:0", "cuda:1"], placement=segs(data))) == ["W006"]
    synced = {**data, "parallel": {"mode": "data", "sync_batchnorm": True}}
    assert codes(spec_with(model=model, devices=["cuda:0", "cuda:1"], placement=segs(synced))) == []
    assert codes(spec_with(model=model)) == []  # one device: the whole batch
    piped = spec_with(model=model, devices=["cuda:0", "cuda:1"], pipeline={"microbatches": 2, "schedule": "gpipe"},
                      placement=segs({"layers": "inp..bn", "device": "cuda:0"},
                                     {"layers": f"{layers[1]['name']}..head", "device": "cuda:1"}))
    assert codes(piped) == ["W006"]


def test_dropout_warns_only_with_several_devices():
    model = {**BASE["model"], "layers": BASE["model"]["layers"][:2] + [{"name": "drop", "op": "Dropout"}]
             + BASE["model"]["layers"][2:]}
    many = spec_with(model=model, devices=["cuda:0", "cuda:1"],
                     placement=segs({"layers": "inp..head", "devices": ["cuda:0", "cuda:1"], "parallel": "data"}))
    assert codes(many) == ["W003"]
    assert codes(spec_with(model=model)) == []
    model["layers"][2]["kwargs"] = {"p": 0}
    assert codes(many) == []


# --- pipelines


def pipe(schedule: str, groups: list, microbatches: int = 4, batch: int = 8) -> dict:
    sels = ["inp..act", "block.0", "block.1", "block.2", "block.3..head"]
    n = len(groups)
    sels = sels[:n - 1] + ["..".join([sels[n - 1].split("..")[0], "head"])]
    devices = sorted({d for g in groups for d in g})
    return spec_with(devices=devices, placement=[
        {"layers": s, "device": g[0]} if len(g) == 1 else {"layers": s, "devices": g, "parallel": "data"}
        for s, g in zip(sels, groups)],
        pipeline={"microbatches": microbatches, "schedule": schedule},
        training={**BASE["training"], "batch_size": batch})


A, B, C = ["cuda:0"], ["cuda:1"], ["cuda:2"]


@pytest.mark.parametrize("schedule, groups, want", [
    ("gpipe", [A, B], []),
    ("1f1b", [A, B, C], []),
    ("1f1b", [A, B, A, B], ["P046"]),
    ("interleaved_1f1b", [A, B, A, B], []),
    ("interleaved_1f1b", [A, B, C, A, B, C][:4], ["P047"]),
    ("interleaved_1f1b", [A, B], ["P047"]),             # one stage per device: that is 1f1b
    ("looped_bfs", [A, B, A, B], []),
    ("interleaved_zero_bubble", [A, B, A, B], []),
    ("zbv_zero_bubble", [A, B, B, A], []),              # the V's middle stages share a device by design
    ("dualpipev", [A, B, B, A], []),
    ("zbv_zero_bubble", [A, B, A, B], ["P048"]),
    ("interleaved_1f1b", [A, B, B, A], ["P043", "P048"]),  # only a V may put neighbours together
    ("gpipe", [A, A], ["P043", "P046"]),
    ("1f1b", [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], []),
    ("1f1b", [["cuda:0", "cuda:1"], C], []),          # placer's own loops run it in 1F1B's order
    ("interleaved_1f1b", [["cuda:0", "cuda:1"], C, ["cuda:0", "cuda:1"], C], []),  # and in any schedule's
    ("gpipe", [["cuda:0", "cuda:1"], C], []),
])
def test_pipeline_layouts(schedule, groups, want):
    assert sorted(codes(pipe(schedule, groups), "error")) == sorted(want)


def test_pipeline_microbatch_rules():
    assert codes(pipe("1f1b", [A, B, C], microbatches=2)) == ["P049"]
    assert codes(pipe("gpipe", [A, B, C], microbatches=2)) == []
    assert codes(pipe("1f1b", [A, B], microbatches=3, batch=8)) == ["P041"]
    data_stages = [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert codes(pipe("1f1b", data_stages, microbatches=8, batch=8)) == ["P042", "P042"]


# --- names, shapes, data


def test_names_are_checked_without_torch_and_hint_the_closest():
    d = spec_with(model={**BASE["model"], "loss": "crossentropyloss"},
                  training={**BASE["training"], "optimizer": {"op": "adam"}})
    diags = run(d)[1]
    assert [(x.code, x.hint) for x in diags] == [("P051", "did you mean 'CrossEntropyLoss'?"),
                                                 ("P052", "did you mean 'Adam'?")]


def test_shape_chain_reports_the_first_bad_layer():
    model = copy.deepcopy(BASE["model"])
    model["layers"][2]["args"] = [15, 16]
    diags = run(spec_with(model=model))[1]
    assert [x.code for x in diags] == ["P060"] and "'block.0'" in diags[0].message


def test_module_model_skips_layer_checks_but_needs_its_file(tmp_path):
    d = spec_with(model={"module": "models/net.py:Net", "input": {"shape": ["B", 8]},
                         "target": {"shape": ["B"], "dtype": "int64", "high": 2}, "loss": "CrossEntropyLoss"},
                  devices=["cuda:0"], placement=segs({"layers": "anything.at.all", "device": "cuda:0"}))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    with pytest.raises(SpecError) as e:
        check.load_spec(str(path))
    assert [x.code for x in e.value.diagnostics] == ["P054"]
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text("raise SystemExit('never imported by validate')\n")
    spec = check.load_spec(str(path))
    assert spec.model.module == "models/net.py:Net" and not spec.model.inline


def test_load_spec_raises_errors_only(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_with(devices=["cuda:0", "cuda:1"]), sort_keys=False))
    spec = check.load_spec(str(path))  # W001 alone does not fail
    assert spec.devices == ("cuda:0", "cuda:1")


def test_errors_sort_before_warnings_then_by_position():
    d = spec_with(devices=["cuda:0", "cuda:1", "cuda:2"],
                  placement=segs({"layers": "inp..block.1", "device": "cuda:0"},
                                 {"layers": "block.2..head", "device": "cuda:7"}))
    diags = run(d)[1]
    assert [x.severity for x in diags] == ["error", "warning", "warning"]
    assert [x.loc.line for x in diags[1:]] == sorted(x.loc.line for x in diags[1:])


def test_typed_spec_defaults():
    spec, _ = run(spec_with(runtime={"simulate": True}))
    assert spec.runtime.simulate == "always" and spec.route == "direct" and spec.training.prefetch == "auto"
    assert spec.placement[0].parallel.mode == "none" and spec.training.data.module is None
    assert [l.name for l in spec.model.layers] == NAMES


# --- diagnostics helpers


def test_closest_prefers_a_case_insensitive_match():
    assert closest("Adamw", ["Adam", "AdamW", "Adamax"]) == "AdamW"
    assert closest("linaer", ["Linear", "Bilinear"]) == "Linear"
    assert closest("zzz", ["Linear"]) is None
    assert did_you_mean("1F1B", ["gpipe", "1f1b"]) == "did you mean '1f1b'?"


def test_name_hint_lists_short_sets_and_guesses_in_long_ones():
    assert name_hint("devices", "cuda:2", ["cuda:0", "cuda:1"]) == "devices are cuda:0, cuda:1 (did you mean 'cuda:1'?)"
    many = [f"Op{i}" for i in range(20)]
    assert name_hint("ops", "op3", many) == "did you mean 'Op3'?"
    assert name_hint("ops", "zzzz", many).endswith("... (20 in all)")


def test_report_counts_what_is_not_shown():
    diags = [Diagnostic("P001", "m", Loc("f", i + 1, 1)) for i in range(12)]
    diags.append(Diagnostic("W001", "w", Loc("f", 20, 1), severity="warning"))
    text = format_report(diags, "text", max_shown=10)
    assert text.splitlines()[-1] == "2 more errors, 1 more warning"


def test_pipeline_stages_torch_schedules_do_not_take_run_as_placers_loops_under_every_schedule():
    d = pipe("looped_bfs", [["cuda:0"], ["cuda:1"], ["cuda:0"], ["cuda:1"]])
    d["copies"] = {"route": "via_host"}
    assert codes(d) == []  # placer's loops run it in looped BFS's order
    two = spec_with(devices=["cuda:0", "cuda:1"], pipeline={"microbatches": 2, "schedule": "1f1b"},
                    copies={"route": "via_host"}, placement=segs({"layers": "inp", "device": "cuda:0"},
                                                                 {"layers": "act..head", "device": "cuda:1"}))
    assert codes(two) == []  # 1f1b runs as placer's loops in its order
    two["pipeline"]["schedule"] = "gpipe"  # gpipe runs as micro-batch loops on placer's copies
    assert codes(two) == []
    for schedule, groups, split in (("1f1b", [A, B + C], 1), ("interleaved_1f1b", [A, B + C, A, B + C], 3),
                                    ("zbv_zero_bubble", [A, B + C, B + C, A], 2)):
        spec = pipe(schedule, groups)  # a channel stage beside one device: placer's loops, in the order
        spec["placement"][split]["parallel"] = "channel"
        assert codes(spec) == [], schedule
    # a stage whose devices are data replicas of a split (2-D): placer's loops too, in the order
    wide = pipe("1f1b", [A, ["cuda:1", "cuda:2", "cuda:3", "cuda:4"]])
    wide["placement"][1]["parallel"] = {"mode": "channel", "data": 2}
    assert codes(wide) == []


def test_split_modes_of_a_module_model_warn_that_generate_cannot_write_them():
    model = {"module": "models/tinygpt.py:TinyGPT", "input": {"shape": ["B", 8], "dtype": "int64", "high": 16},
             "target": {"shape": ["B", 8], "dtype": "int64", "high": 16}, "loss": "CrossEntropyLoss"}
    two = ["cuda:0", "cuda:1"]
    # channel, spatial: the only segment runs in lockstep (validate --deep checks the chain); tensor:
    # a plan per transformer block, when it holds the whole model
    for mode in ("data", "tensor", "channel", "spatial"):
        spec = spec_with(model=model, devices=two, placement=segs({"layers": "*", "devices": two, "parallel": mode}))
        assert "W007" not in codes(spec), mode
    three = [*two, "cuda:2"]
    beside = spec_with(model=model, devices=three, placement=segs(
        {"layers": "embed", "device": "cuda:2"}, {"layers": "blocks.0..lm_head", "devices": two, "parallel": "tensor"}))
    assert "W007" not in codes(beside)  # in lockstep, on devices of its own
    beside["placement"][0]["device"] = "cuda:0"  # a device of the group: not generated
    assert "W007" in codes(beside)
    beside["placement"][0]["device"] = "cuda:2"
    beside["pipeline"] = {"microbatches": 2, "schedule": "1f1b"}  # lockstep's loops in the schedule's order
    assert "W007" not in codes(beside)
    # under interleaved 1F1B, two groups on the same devices (each rank holds two stages alike)
    inter = spec_with(model=model, devices=three, pipeline={"microbatches": 2, "schedule": "interleaved_1f1b"},
                      placement=segs({"layers": "embed", "device": "cuda:2"},
                                     {"layers": "blocks.0", "devices": two, "parallel": "tensor"},
                                     {"layers": ["blocks.1", "ln_f"], "device": "cuda:2"},
                                     {"layers": "lm_head", "devices": two, "parallel": "channel"}))
    assert "W007" not in codes(inter)
    inter["training"]["precision"] = "bf16"  # channel and tensor groups in lockstep take bf16
    assert "W007" not in codes(inter)
    inter["placement"][3]["devices"] = ["cuda:1", "cuda:0"]  # a group overlapping another, not the same
    assert "W007" in codes(inter)
    stem = spec_with(model=model, devices=three, pipeline={"microbatches": 2, "schedule": "zbv_zero_bubble"},
                     placement=segs({"layers": "embed", "devices": two, "parallel": "spatial"},
                                    {"layers": "blocks.0", "device": "cuda:2"},
                                    {"layers": ["blocks.1", "ln_f"], "device": "cuda:2"},
                                    {"layers": "lm_head", "devices": two, "parallel": "channel"}))
    assert "W007" not in codes(stem)  # spatial in a pipeline, beside one-device stages (the layers are not checked here)
    stem["placement"][1]["device"] = "cuda:1"
    assert "W007" in codes(stem)
