"""The mode registry: one file per parallel mode behind one interface, and no stage outside
`placer/modes/` that decides by a mode's name."""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

from placer.modes import MODES, Mode
from placer.spec import types

PLACER = Path(__file__).resolve().parents[2] / "placer"
SCHEMA = json.loads((PLACER / "schemas" / "placer-spec.schema.json").read_text())["$defs"]


def test_the_registry_holds_every_mode_the_schema_and_the_spec_types_name():
    assert list(MODES) == list(types.MODES) == SCHEMA["parallel_mode"]["enum"]
    assert all(isinstance(m, Mode) and m.name == name for name, m in MODES.items())


def test_each_modes_options_are_the_schemas_and_fields_of_parallel():
    allowed: dict[str, set] = {}
    for rule in SCHEMA["parallel"]["allOf"]:
        mode = rule["if"]["properties"].get("mode")
        if mode:
            for name in mode.get("enum", [mode.get("const")]):
                allowed[name] = set(rule["then"]["properties"]) - {"mode"}
    fields = {f.name for f in dataclasses.fields(types.Parallel)}
    for name, mode in MODES.items():
        assert set(mode.options_keys) == allowed[name], name
        assert set(mode.options_keys) <= fields


def test_a_mode_overrides_only_what_the_interface_declares():
    """A misspelt hook would silently fall back to the one-device default."""
    declared = {n for n, _ in inspect.getmembers(Mode) if not n.startswith("_")}
    for mode in MODES.values():
        own = {n for c in type(mode).__mro__[:-2] for n in vars(c) if not n.startswith("_")}
        assert own <= declared, (mode.name, own - declared)
        for n in own & declared:
            if callable(getattr(Mode, n)):
                assert inspect.signature(getattr(type(mode), n)) .parameters.keys() == \
                    inspect.signature(getattr(Mode, n)).parameters.keys(), (mode.name, n)


NAMED = re.compile(r"""mode\s*(==|!=|in|not in)\s*\(?[^)\n]*["'](data|channel|tensor|spatial)["']""")


def test_no_stage_outside_the_mode_files_decides_by_a_modes_name():
    found = []
    for path in PLACER.rglob("*.py"):
        if "modes" in path.relative_to(PLACER).parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if NAMED.search(line):
                found.append(f"{path.relative_to(PLACER)}:{i}: {line.strip()}")
    assert not found, "ask placer.modes.MODES[seg.mode] instead:\n" + "\n".join(found)
