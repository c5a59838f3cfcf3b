"""Hints for the words users bring from DDP, FSDP, ZeRO, Megatron and YAML 1.1."""
from __future__ import annotations

from pathlib import Path

import pytest

from placer.spec import check, load

BASE = (Path(__file__).resolve().parents[1] / "cases" / "invalid" / "bad_enum" / "spec.yaml").read_text()
BASE = BASE.replace("via-host", "direct")
SEGMENT = "  - {layers: fc1..act1, device: cuda:0}"


def first(text: str):
    _, diags = check.validate_document(load.load_text(text, "spec.yaml"))
    assert diags, "expected an error"
    return diags[0]


def with_parallel(parallel: str) -> str:
    return BASE.replace(SEGMENT, f"  - {{layers: fc1..act1, devices: [cuda:0, cuda:1], parallel: {parallel}}}")


@pytest.mark.parametrize("parallel, says", [
    ("ddp", "parallel: data"),
    ("DDP", "parallel: data"),
    ("fsdp", "{mode: data, shard: full}"),
    ("zero3", "{mode: data, shard: full}"),
    ("ZeRO-1", "{mode: data, shard: optimizer}"),
    ("zero2", "placer has no ZeRO-2"),
    ("tp", "parallel: tensor"),
    ("pp", "`pipeline: {microbatches: 8, schedule: 1f1b}`"),
    ("{mode: fsdp}", "shard: full"),
    ("{mode: data, shard: zero1}", "`shard: optimizer`"),
    ("{mode: data, shard: zero}", "`shard: optimizer`"),
    ("{mode: data, shard: zero2}", "`shard: optimizer` is ZeRO-1"),
    ("{mode: data, shard: zero3}", "`shard: full`"),
])
def test_modes_from_the_literature_get_placer_words(parallel, says):
    d = first(with_parallel(parallel))
    assert d.code == "S004" and says in d.hint, d.format()
    assert "allowed:" in d.hint  # still lists the choices


@pytest.mark.parametrize("op", ["nn.Linear", "torch.nn.Linear"])
def test_module_prefix_on_a_class_name(op):
    d = first(BASE.replace("op: Linear, args: [32, 64]", f"op: {op}, args: [32, 64]"))
    assert d.code == "S005" and d.hint.startswith("write 'Linear'"), d.format()


def test_optimizer_prefix():
    d = first(BASE.replace("op: SGD", "op: torch.optim.SGD"))
    assert "write 'SGD'" in d.hint and "torch.optim" in d.hint, d.format()


@pytest.mark.parametrize("word, value", [("no", "false"), ("on", "true"), ("Yes", "true")])
def test_yaml_booleans_where_a_string_was_meant(word, value):
    d = first(BASE.replace("name: base", f"name: {word}"))
    assert d.code == "S003" and f'as {value}' in d.hint and f'name: "{word}"' in d.hint, d.format()


def test_quoted_text_is_not_a_boolean():
    assert check.validate_document(load.load_text(BASE.replace("name: base", 'name: "no"'), "s.yaml"))[1] == []


def test_all_missing_top_level_keys_in_one_report():
    d = first("placer: 1\nname: x\n")
    assert d.code == "S002"
    assert d.message == "missing required keys 'model', 'devices' and 'training' in the spec"  # placement: auto
    one = first(BASE.replace("devices: [cuda:0, cuda:1]\n", ""))
    assert one.message == "missing required key 'devices' in the spec" and one.hint.startswith("devices: ")
