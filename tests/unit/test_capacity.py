"""Devices that state their memory and hardware; `placement: auto` in validate; W008 in plan."""
from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from placer.cli.main import main
from placer.spec.check import load_spec_text
from placer.spec.types import parse_size

MLP = {
    "placer": 1, "name": "cap",
    "model": {"layers": [{"name": "fc1", "op": "Linear", "args": [32, 64]}, {"name": "act", "op": "ReLU"},
                         {"name": "fc2", "op": "Linear", "args": [64, 10]}],
              "input": {"shape": ["B", 32]}, "target": {"shape": ["B"], "dtype": "int64", "high": 10},
              "loss": "CrossEntropyLoss"},
    "devices": [{"name": "cuda:0", "memory": "16KiB", "hardware": "h100"}, "cuda:1"],
    "placement": [{"layers": "fc1..fc2", "device": "cuda:0"}],
    "training": {"batch_size": 8, "steps": 2, "optimizer": {"op": "SGD", "lr": 0.1}},
}


def text(**changes) -> str:
    return yaml.safe_dump({**MLP, **changes}, sort_keys=False)


@pytest.mark.parametrize("value, want", [("80GiB", 80 * 2**30), ("16GB", 16 * 10**9), ("512 MiB", 512 * 2**20),
                                          ("1.5KiB", 1536), (4096, 4096)])
def test_sizes(value, want):
    assert parse_size(value) == want


def test_a_device_states_memory_and_hardware_beside_plain_names():
    spec = load_spec_text(text())
    assert spec.devices == ("cuda:0", "cuda:1")
    assert [(d.name, d.memory, d.hardware) for d in spec.device_specs] == [("cuda:0", 16384, "h100"),
                                                                           ("cuda:1", None, None)]


@pytest.mark.parametrize("devices, first", [
    ([{"name": "cuda:0", "memory": "80Gb"}], "devices[0].memory is \"80Gb\", which is not well formed"),
    ([{"name": "cuda:0", "hardware": "h10"}], "devices[0].hardware is \"h10\"; not an allowed value"),
    ([{"name": "cuda:0", "memroy": 1}], "unknown key 'memroy' in devices[0]"),
    ([{"name": "cuda:0"}, "cuda:0"], "device 'cuda:0' is listed twice"),
])
def test_bad_device_entries_are_located_errors(devices, first):
    r = CliRunner().invoke(main, ["validate", "-"], input=text(devices=devices))
    assert r.exit_code == 1 and first in r.output, r.output


def test_placement_auto_or_missing_validates_and_pipeline_beside_it_is_p100():
    spec = dict(MLP)
    spec.pop("placement")
    for doc in (yaml.safe_dump(spec), text(placement="auto")):
        r = CliRunner().invoke(main, ["validate", "-"], input=doc)
        assert r.exit_code == 0 and "placement auto" in r.output, r.output
    r = CliRunner().invoke(main, ["validate", "-"], input=text(placement="auto",
                                                                pipeline={"microbatches": 2}))
    assert r.exit_code == 1 and "error[P100]: 'pipeline' is given but the placement is auto" in r.output


def test_plan_warns_w008_when_a_written_plan_exceeds_a_stated_memory(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(text())
    r = CliRunner().invoke(main, ["plan", str(path)])
    assert r.exit_code == 0, r.output
    assert "warning[W008]: device 'cuda:0' is estimated to need" in r.output
    assert "over the 16.0 KiB its entry states" in r.output
