"""The JSON Schema of a spec: well-formed, documented, and right on small cases."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

import placer
from placer.spec import types

SCHEMA_PATH = Path(placer.__file__).parent / "schemas" / "placer-spec.schema.json"
SCHEMA = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
VALIDATOR = Draft202012Validator(SCHEMA)
REPO = Path(__file__).resolve().parents[2]

# Keywords whose value is a map from names to subschemas.
MAP_KEYWORDS = ("properties", "$defs", "dependentSchemas", "patternProperties")
# Keywords whose value is one subschema or a list of them.
SUB_KEYWORDS = (
    "items", "additionalProperties", "propertyNames", "not", "if", "then", "else",
    "allOf", "anyOf", "oneOf", "contains", "prefixItems",
)


# Keywords whose subschemas only constrain (they declare no keys of their own).
CONDITIONAL = ("dependentSchemas", "not", "if", "then", "else", "allOf", "anyOf", "oneOf", "contains")


def walk(schema, where="#", conditional=False):
    """Yield (location, subschema, inside-a-conditional) for every subschema."""
    yield where, schema, conditional
    if not isinstance(schema, dict):
        return
    for kw in MAP_KEYWORDS:
        for name, sub in schema.get(kw, {}).items():
            yield from walk(sub, f"{where}/{kw}/{name}", conditional or kw in CONDITIONAL)
    for kw in SUB_KEYWORDS:
        value = schema.get(kw)
        subs = enumerate(value) if isinstance(value, list) else [(None, value)] if value is not None else []
        for i, sub in subs:
            loc = f"{where}/{kw}" if i is None else f"{where}/{kw}/{i}"
            yield from walk(sub, loc, conditional or kw in CONDITIONAL)


def declaring_schemas():
    """Object schemas that declare keys (not conditionals): (location, schema)."""
    for where, sub, conditional in walk(SCHEMA):
        if isinstance(sub, dict) and "properties" in sub and not conditional:
            yield where, sub


# --------------------------------------------------------------------------- meta


def test_schema_is_valid_draft_2020_12():
    Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA["$id"] == "https://placer.dev/schemas/placer-spec-v1.schema.json"
    assert SCHEMA["title"]
    assert SCHEMA["description"]


def test_walk_sees_every_object():
    where = {w for w, _ in declaring_schemas()}
    assert {"#", "#/$defs/model", "#/$defs/segment", "#/$defs/parallel", "#/$defs/training"} <= where
    assert len(where) >= 13


def test_every_property_has_a_description():
    missing = [
        f"{where}/properties/{name}"
        for where, sub in declaring_schemas()
        for name, prop in sub["properties"].items()
        if not (isinstance(prop, dict) and prop.get("description"))
    ]
    assert not missing, missing


def test_every_definition_has_a_description():
    assert [n for n, d in SCHEMA["$defs"].items() if not d.get("description")] == []


def test_declared_objects_reject_unknown_keys():
    for where, sub in declaring_schemas():
        assert sub.get("type") == "object", where
        assert sub.get("additionalProperties") is False, where


def test_conditional_key_lists_name_declared_properties():
    """Conditionals only name keys that their object declares (no typos, no new keys)."""
    for where, sub in declaring_schemas():
        declared = set(sub["properties"])
        for kw in CONDITIONAL:
            if kw not in sub:
                continue
            for inner_where, inner, _ in walk({kw: sub[kw]}, where):
                if not isinstance(inner, dict):
                    continue
                names = set(inner.get("properties", {})) | set(inner.get("required", []))
                if kw == "dependentSchemas" and inner_where.count("/") == where.count("/") + 2:
                    names.add(inner_where.rsplit("/", 1)[1])
                assert names <= declared, f"{inner_where}: {sorted(names - declared)}"


def _allowed(conditional: dict) -> set[str]:
    assert conditional["additionalProperties"] is False
    return set(conditional["properties"])


def test_exclusive_key_lists_stay_in_sync_with_properties():
    defs = SCHEMA["$defs"]
    model = defs["model"]
    assert _allowed(model["dependentSchemas"]["layers"]) == set(model["properties"]) - {"module", "kwargs", "output",
                                                                                        "inputs"}
    assert _allowed(model["dependentSchemas"]["inputs"]) == set(model["properties"]) - {"layers", "input"}
    own_loss = next(r["then"] for r in model["allOf"] if r["if"].get("properties", {}).get("output"))
    assert _allowed(own_loss) == set(model["properties"]) - {"target", "loss"}
    segment = defs["segment"]
    assert _allowed(segment["dependentSchemas"]["device"]) == set(segment["properties"]) - {"devices"}
    parallel = defs["parallel"]
    by_mode = {}
    for rule in parallel["allOf"]:
        mode = rule["if"].get("properties", {}).get("mode")
        if mode is not None:
            for m in mode.get("enum", [mode.get("const")]):
                by_mode[m] = _allowed(rule["then"])
    assert set(by_mode) == set(defs["parallel_mode"]["enum"])
    assert by_mode["data"] == set(parallel["properties"]) - {"dim", "data"}
    # data replicas (a 2-D segment), each split by the mode; shard over them (ZeRO-1; FSDP2 x TP for tensor)
    two_d_sync = {"sync", "server"}  # data's sync across a 2-D segment's replicas (parameter_server too)
    assert by_mode["spatial"] == {"mode", "dim", "data", "shard"} | two_d_sync
    assert by_mode["tensor"] == {"mode", "data", "shard"} | two_d_sync
    assert by_mode["channel"] == {"mode", "data", "shard"} | two_d_sync
    assert by_mode["none"] == {"mode"}


def test_defaults_are_valid_values():
    for where, sub, _ in walk(SCHEMA):
        if isinstance(sub, dict) and "default" in sub:
            check = Draft202012Validator({**sub, "$defs": SCHEMA["$defs"]})
            assert not list(check.iter_errors(sub["default"])), where


def test_defaults_from_spec_md():
    defs = SCHEMA["$defs"]
    par = defs["parallel"]["properties"]
    assert par["sync"]["default"] == "allreduce"
    assert par["bucket_mb"]["default"] == 25
    assert par["overlap"]["default"] is True
    assert par["sync_batchnorm"]["default"] is False
    assert defs["pipeline"]["properties"]["schedule"]["default"] == "1f1b"
    assert defs["copies"]["properties"]["route"]["default"] == "direct"
    assert defs["tensor"]["properties"]["dtype"]["default"] == "float32"
    tr = defs["training"]["properties"]
    assert (tr["seed"]["default"], tr["prefetch"]["default"], tr["data"]["default"]) == (0, "auto", "synthetic")
    rt = defs["runtime"]["properties"]
    assert (rt["backend"]["default"], rt["simulate"]["default"], rt["max_restarts"]["default"]) == ("auto", "auto", 0)



def _field_default(cls, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# Where each default of the schema lives in Python: (dataclass, field), or the value a
# schema default stands for when no field holds it.
PY_DEFAULTS = {
    "#/$defs/copies/properties/route": (types.Spec, "route"),
    "#/$defs/checkpoint/properties/dir": (types.Checkpoint, "dir"),
    "#/$defs/tensor/properties/dtype": (types.TensorSpec, "dtype"),
    "#/$defs/tensor/properties/low": (types.TensorSpec, "low"),
    "#/$defs/layer/properties/args": (types.Layer, "args"),
    "#/$defs/layer/properties/kwargs": (types.Layer, "kwargs"),
    "#/$defs/layer/properties/repeat": None,  # no repeat is one layer named `name`, not `name.0`
    **{f"#/$defs/parallel/properties/{k}": (types.Parallel, k)
       for k in ("sync", "bucket_mb", "overlap", "shard", "sync_batchnorm", "dim", "data")},
    "#/$defs/segment/properties/parallel": (types.Parallel, "mode"),
    "#/$defs/pipeline/properties/schedule": (types.Pipeline, "schedule"),
    "#/$defs/training/properties/seed": (types.Training, "seed"),
    "#/$defs/training/properties/prefetch": (types.Training, "prefetch"),
    "#/$defs/training/properties/precision": (types.Training, "precision"),
    "#/$defs/training/properties/accumulate": (types.Training, "accumulate"),
    "#/$defs/segment/properties/recompute": (types.Segment, "recompute"),
    "#/$defs/training/properties/data": None,  # "synthetic": Data() (checked below)
    **{f"#/$defs/runtime/properties/{k}": (types.Runtime, k)
       for k in ("backend", "simulate", "timeout_s", "max_restarts")},
}


def test_schema_defaults_equal_the_dataclass_defaults():
    """One source of defaults: every `default` the schema states is the dataclass's (spec/types.py)."""
    found = {where: sub["default"] for where, sub, _ in walk(SCHEMA) if isinstance(sub, dict) and "default" in sub}
    assert set(found) == set(PY_DEFAULTS), "map each schema default to its dataclass field here"
    for where, value in found.items():
        if PY_DEFAULTS[where]:
            py = _field_default(*PY_DEFAULTS[where])
            py = list(py) if isinstance(py, tuple) else py
            assert py == value and isinstance(py, bool) == isinstance(value, bool), (where, py, value)
    assert types.Data().module is None and found["#/$defs/training/properties/data"] == "synthetic"
    assert types.DEFAULT_PARALLEL == types.Parallel() and types.DEFAULT_PARALLEL.bucket_mb == 25


def test_from_document_leaves_defaults_to_the_dataclasses():
    from placer.spec.load import load_text

    spec = types.from_document(load_text(yaml.safe_dump({**MINIMAL, "placement": [
        {"layers": "fc1", "devices": ["cpu", "cpu:1"], "parallel": "data"}]}), "spec.yaml"))
    assert spec.placement[0].parallel == types.Parallel(mode="data")
    assert (spec.route, spec.model.input, spec.training.seed, spec.runtime) == (
        "direct", types.TensorSpec(shape=("B", 784)), 0, types.Runtime())

# ---------------------------------------------------------------------- instances

MINIMAL = {
    "placer": 1,
    "name": "mlp",
    "model": {
        "layers": [{"name": "fc1", "op": "Linear", "args": [784, 10]}],
        "input": {"shape": ["B", 784]},
        "target": {"shape": ["B"], "dtype": "int64", "high": 10},
        "loss": "CrossEntropyLoss",
    },
    "devices": ["cpu"],
    "placement": [{"layers": "fc1", "device": "cpu"}],
    "training": {"batch_size": 8, "steps": 2, "optimizer": {"op": "SGD", "lr": 0.1}},
}

# Every key SPEC.md shows, in one spec (YAML, as a user writes it).
FULL_YAML = """
placer: 1
name: mlp-4gpu
description: every key of the spec, once
model:
  layers:
    - {name: fc1, op: Linear, args: [784, 512]}
    - {name: act1, op: ReLU}
    - {name: block, op: Linear, args: [512, 512], repeat: 4}
    - {name: head, op: Linear, args: [512, 10], kwargs: {bias: true}}
  input:  {shape: [B, 784]}
  target: {shape: [B], dtype: int64, high: 10, low: 0}
  loss: CrossEntropyLoss
devices: [cpu, cuda:0, cuda:1, cuda:2, cuda:3, node1/cuda:0, cpu:1]
placement:
  - {layers: [fc1, act1], device: cuda:0, name: stem, copies: {route: via_host}}
  - layers: block.0..block.1
    devices: [cuda:1, cuda:2]
    parallel: {mode: data, sync: parameter_server, server: cpu, bucket_mb: 12.5,
               overlap: false, shard: optimizer, sync_batchnorm: true}
  - {layers: "block.*", devices: [cuda:3, node1/cuda:0], parallel: tensor}
  - {layers: head, devices: [cpu, cpu:1], parallel: {mode: spatial, dim: W}}
pipeline: {microbatches: 8, schedule: 1f1b}
copies: {route: direct}
training:
  batch_size: 64
  steps: 20
  optimizer: {op: SGD, lr: 0.05, kwargs: {momentum: 0.9}}
  seed: 0
  data: {module: data.py:make_batches, kwargs: {n: 3}}
  prefetch: 0
  checkpoint: {dir: ckpt, every: 10, keep: 3}
runtime:
  backend: auto
  simulate: auto
  timeout_s: 300
  max_restarts: 0
"""

MODULE_YAML = """
placer: 1
name: tinygpt
model:
  module: models/tinygpt.py:TinyGPT
  kwargs: {vocab: 256, d_model: 128, n_layers: 4, seq: 64}
  input:  {shape: [B, 64], dtype: int64, high: 256}
  target: {shape: [B, 64], dtype: int64, high: 256}
  loss: CrossEntropyLoss
devices: [cuda:0, cuda:1]
placement:
  - {layers: [embed, blocks.0, blocks.1], device: cuda:0}
  - {layers: [blocks.2, blocks.3, lm_head], device: cuda:1}
pipeline: {microbatches: 4, schedule: interleaved_1f1b}
training: {batch_size: 16, steps: 5, optimizer: {op: AdamW}, data: synthetic}
"""


def errors(instance):
    return list(VALIDATOR.iter_errors(instance))


def with_change(change):
    spec = copy.deepcopy(MINIMAL)
    change(spec)
    return spec


@pytest.mark.parametrize(
    "spec",
    [MINIMAL, yaml.safe_load(FULL_YAML), yaml.safe_load(MODULE_YAML)],
    ids=["minimal", "full", "module"],
)
def test_valid_specs(spec):
    assert errors(spec) == []


def seg(**kw):
    return lambda s: s["placement"][0].update(kw)


def group(parallel):
    """Change the first segment to `devices: [cpu]` with `parallel`."""

    def change(s):
        s["placement"][0].pop("device")
        s["placement"][0].update(devices=["cpu"], parallel=parallel)

    return change


VALID_CHANGES = {
    "devices list of one, parallel none": group("none"),
    "data parallel mapping": group({"mode": "data"}),
    "data parallel, all options": group(
        {"mode": "data", "sync": "broadcast", "bucket_mb": 1, "overlap": True, "shard": "full", "sync_batchnorm": False}
    ),
    "spatial with integer dim": group({"mode": "spatial", "dim": -1}),
    "tensor mapping": group({"mode": "tensor"}),
    "channel x data, ZeRO-1": group({"mode": "channel", "data": 2, "shard": "optimizer"}),
    "spatial x data, ZeRO-1": group({"mode": "spatial", "dim": "H", "data": 2, "shard": "optimizer"}),
    "simulate true": lambda s: s.update(runtime={"simulate": True}),
    "simulate never": lambda s: s.update(runtime={"simulate": "never"}),
    "every schedule": lambda s: s.update(pipeline={"microbatches": 2, "schedule": "dualpipev"}),
    "name with dash": lambda s: s.update(name="my-spec_2"),
    "cuda device name": lambda s: s.update(devices=["node3/cuda:12", "cpu:2"]),
    "layer kwargs": lambda s: s["model"]["layers"][0].update(kwargs={"bias": False, "dtype": None}),
}


@pytest.mark.parametrize("change", VALID_CHANGES.values(), ids=VALID_CHANGES.keys())
def test_valid_changes(change):
    assert errors(with_change(change)) == []


def remove_layers_add_module(s):
    s["model"].pop("layers")
    s["model"]["module"] = "models/x.py"


# (change, path of the best error, its keyword, a piece of its message)
INVALID = {
    "unknown top-level key": (lambda s: s.update(traning={}), [], "additionalProperties", "'traning'"),
    "typo of a required key": (
        lambda s: s.update(traning=s.pop("training")), [], "additionalProperties", "'traning'",
    ),
    "missing required key": (lambda s: s.pop("devices"), [], "required", "'devices'"),
    "version 2": (lambda s: s.update(placer=2), ["placer"], "const", "1"),
    "bad name": (lambda s: s.update(name="1mlp"), ["name"], "pattern", "'1mlp'"),
    "batch_size as string": (
        lambda s: s["training"].update(batch_size="64"), ["training", "batch_size"], "type", "integer",
    ),
    "batch_size float": (
        lambda s: s["training"].update(batch_size=6.5), ["training", "batch_size"], "type", "integer",
    ),
    "steps zero": (lambda s: s["training"].update(steps=0), ["training", "steps"], "minimum", "0"),
    "optimizer without op": (
        lambda s: s["training"]["optimizer"].pop("op"), ["training", "optimizer"], "required", "'op'",
    ),
    "typo in a layer": (
        lambda s: s["model"]["layers"][0].update(arg=[1]), ["model", "layers", 0], "additionalProperties", "'arg'",
    ),
    "repeat zero": (
        lambda s: s["model"]["layers"][0].update(repeat=0), ["model", "layers", 0, "repeat"], "minimum", "0",
    ),
    "kwargs key not an identifier": (
        lambda s: s["model"]["layers"][0].update(kwargs={"1x": 1}), ["model", "layers", 0, "kwargs"], "pattern", "'1x'",
    ),
    "both layers and module": (
        lambda s: s["model"].update(module="m.py:M"), ["model"], "additionalProperties", "'module'",
    ),
    "kwargs with inline layers": (
        lambda s: s["model"].update(kwargs={}), ["model"], "additionalProperties", "'kwargs'",
    ),
    "neither layers nor module": (lambda s: s["model"].pop("layers"), ["model"], "required", "'layers'"),
    "typo of layers": (
        lambda s: s["model"].update(lyers=s["model"].pop("layers")), ["model"], "additionalProperties", "'lyers'",
    ),
    "module without class": (remove_layers_add_module, ["model", "module"], "pattern", "models/x.py"),
    "shape zero": (
        lambda s: s["model"]["input"].update(shape=["B", 0]), ["model", "input", "shape", 1], "minimum", "0",
    ),
    "shape lowercase b": (
        lambda s: s["model"]["input"].update(shape=["b", 4]), ["model", "input", "shape", 0], "pattern", "'b'",
    ),
    "unknown dtype": (
        lambda s: s["model"]["input"].update(dtype="float"), ["model", "input", "dtype"], "enum", "'float'",
    ),
    "no devices": (lambda s: s.update(devices=[]), ["devices"], "minItems", "non-empty"),
    "bad device name": (lambda s: s.update(devices=["gpu:0"]), ["devices", 0], "pattern", "'gpu:0'"),
    "duplicate device": (lambda s: s.update(devices=["cpu", "cpu"]), ["devices"], "uniqueItems", "non-unique"),
    "empty placement": (lambda s: s.update(placement=[]), ["placement"], "minItems", "non-empty"),
    "device and devices": (seg(devices=["cpu"]), ["placement", 0], "additionalProperties", "'devices'"),
    "neither device nor devices": (
        lambda s: s["placement"][0].pop("device"), ["placement", 0], "required", "'device'",
    ),
    "typo of device": (
        lambda s: s["placement"][0].update(devcie=s["placement"][0].pop("device")),
        ["placement", 0], "additionalProperties", "'devcie'",
    ),
    "layers not a string": (seg(layers=3), ["placement", 0, "layers"], "type", "'string', 'array'"),
    "layers empty list": (seg(layers=[]), ["placement", 0, "layers"], "minItems", "non-empty"),
    "unknown mode": (seg(parallel="dta"), ["placement", 0, "parallel"], "enum", "'dta'"),
    "unknown mode in mapping": (
        seg(parallel={"mode": "dat", "sync": "allreduce"}), ["placement", 0, "parallel", "mode"], "enum", "'dat'",
    ),
    "mapping without mode": (seg(parallel={"sync": "allreduce"}), ["placement", 0, "parallel"], "required", "'mode'"),
    "typo of an option": (
        seg(parallel={"mode": "data", "sink": "allreduce"}),
        ["placement", 0, "parallel"], "additionalProperties", "'sink'",
    ),
    "data option under channel": (
        seg(parallel={"mode": "channel", "bucket_mb": 10}),
        ["placement", 0, "parallel"], "additionalProperties", "'bucket_mb'",
    ),
    "dim under data": (
        seg(parallel={"mode": "data", "dim": "H"}), ["placement", 0, "parallel"], "additionalProperties", "'dim'",
    ),
    "bad dim": (seg(parallel={"mode": "spatial", "dim": "X"}), ["placement", 0, "parallel", "dim"], "enum", "'X'"),
    "parameter_server without server": (
        seg(parallel={"mode": "data", "sync": "parameter_server"}),
        ["placement", 0, "parallel"], "required", "'server'",
    ),
    "server without sync": (
        seg(parallel={"mode": "data", "server": "cpu"}), ["placement", 0, "parallel"], "dependentRequired", "'sync'",
    ),
    "server with allreduce": (
        seg(parallel={"mode": "data", "sync": "allreduce", "server": "cpu"}),
        ["placement", 0, "parallel", "sync"], "const", "parameter_server",
    ),
    "bucket_mb zero": (
        seg(parallel={"mode": "data", "bucket_mb": 0}),
        ["placement", 0, "parallel", "bucket_mb"], "exclusiveMinimum", "0",
    ),
    "parallel a number": (seg(parallel=3), ["placement", 0, "parallel"], "type", "'string', 'object'"),
    "bad copies route": (seg(copies={"route": "host"}), ["placement", 0, "copies", "route"], "enum", "'host'"),
    "pipeline without microbatches": (lambda s: s.update(pipeline={}), ["pipeline"], "required", "'microbatches'"),
    "unknown schedule": (
        lambda s: s.update(pipeline={"microbatches": 2, "schedule": "1F1B"}),
        ["pipeline", "schedule"], "enum", "'1F1B'",
    ),
    "data a wrong word": (
        lambda s: s["training"].update(data="synth"), ["training", "data"], "const", "'synthetic'",
    ),
    "data mapping typo": (
        lambda s: s["training"].update(data={"modul": "d.py:f"}),
        ["training", "data"], "additionalProperties", "'modul'",
    ),
    "negative prefetch": (lambda s: s["training"].update(prefetch=-1), ["training", "prefetch"], "minimum", "-1"),
    "checkpoint without every": (
        lambda s: s["training"].update(checkpoint={"dir": "ckpt"}), ["training", "checkpoint"], "required", "'every'",
    ),
    "unknown backend": (lambda s: s.update(runtime={"backend": "mpi"}), ["runtime", "backend"], "enum", "'mpi'"),
    "unknown simulate": (lambda s: s.update(runtime={"simulate": "maybe"}), ["runtime", "simulate"], "enum", "'maybe'"),
    "timeout zero": (lambda s: s.update(runtime={"timeout_s": 0}), ["runtime", "timeout_s"], "exclusiveMinimum", "0"),
    "runtime typo": (lambda s: s.update(runtime={"backnd": "gloo"}), ["runtime"], "additionalProperties", "'backnd'"),
}


@pytest.mark.parametrize(("change", "path", "keyword", "snippet"), INVALID.values(), ids=INVALID.keys())
def test_invalid_specs_best_error(change, path, keyword, snippet):
    errs = errors(with_change(change))
    assert errs, "expected the spec to be invalid"
    best = best_match(errs)
    assert (list(best.absolute_path), best.validator) == (path, keyword), best.message
    assert snippet in best.message


def test_no_weak_combinators():
    """No anyOf/oneOf: their best_match messages ('is not valid under any of the given schemas') are useless."""
    for where, sub, _ in walk(SCHEMA):
        if isinstance(sub, dict):
            assert "anyOf" not in sub and "oneOf" not in sub, where


def test_shipped_valid_specs_match_schema():
    """Example specs and valid test cases (when there are any) pass the schema."""
    paths = sorted((REPO / "specs").glob("**/*.yaml"))
    paths += sorted((REPO / "tests" / "cases" / "valid").glob("*/spec.yaml"))
    for path in paths:
        found = errors(yaml.safe_load(path.read_text(encoding="utf-8")))
        assert found == [], f"{path.relative_to(REPO)}: {best_match(found).message}"
