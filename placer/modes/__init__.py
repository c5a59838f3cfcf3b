"""Parallel modes, one file each: the mode's rule, checks, options, layout, lowering into plan
ops, memory accounting and emission into the program, behind the `Mode` interface
(`base.py`). validate, plan, estimate and codegen look a segment's mode up in `MODES` and
ask it, so one rule holds each fact (which Linears pair, which layers a slice passes
through, what a collective moves). Adding a mode: its file, its line here, its schema
entry (`spec/types.MODES` and the JSON Schema, tested equal to `MODES`) and its docs."""
from placer.modes import channel, data, expert, single, spatial, tensor
from placer.modes.base import Lowering, Mode

MODES: dict[str, Mode] = {m.MODE.name: m.MODE for m in (single, data, channel, tensor, spatial, expert)}

__all__ = ["MODES", "Lowering", "Mode"]
