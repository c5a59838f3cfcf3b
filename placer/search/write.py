"""The spec the search writes: the user's file with the placement in place of `placement: auto`,
and a comment header that says why (placer/search)."""
from __future__ import annotations

from placer import units
from placer.diagnostics import PlacerError
from placer.search.space import Candidate, selectors
from placer.spec.types import Spec


def placement_yaml(c: Candidate, inline: bool) -> str:
    """The `placement:` (and `pipeline:`) lines of a candidate, one flow mapping per segment."""
    lines = ["placement:"]
    for i, s in enumerate(c.stages):
        sel = selectors(s.layers, inline)
        parts = [f"name: s{i}", "layers: " + (sel[0] if len(sel) == 1 else "[" + ", ".join(sel) + "]")]
        parts.append(f"device: {s.devices[0]}" if len(s.devices) == 1 else f"devices: [{', '.join(s.devices)}]")
        if s.mode != "none":
            opts = "".join(f", {k}: {v}" for k, v in s.options)
            parts.append(f"parallel: {{mode: {s.mode}{opts}}}" if opts else f"parallel: {s.mode}")
        if s.recompute:
            parts.append("recompute: true")
        lines.append("  - {" + ", ".join(parts) + "}")
    if c.schedule:
        lines.append(f"pipeline: {{microbatches: {c.microbatches}, schedule: {c.schedule}}}")
    return "\n".join(lines) + "\n"


def header(spec: Spec, c: Candidate, ranked: list[Candidate], hardware: dict, caps: dict) -> str:
    """The comment that says why: predicted step, memory against capacity, the bound, the runners-up."""
    hw = sorted(set(hardware[d] for s in c.stages for d in s.devices))
    lines = [f"placement suggested by `placer suggest` (hardware {', '.join(hw)}):",
             f"  predicted step time {units.seconds(c.step_s)}; {c.bound}", "  memory per device (estimate / capacity):"]
    used = {d for s in c.stages for d in s.devices}
    for d, b in c.memory.items():
        lines.append(f"    {d}: {units.size(b)} / " + (units.size(caps[d]) if d in caps else "no limit stated")
                     + ("" if d in used else " (runs nothing)"))
    others = [o for o in ranked if o is not c][:4]
    if others:
        lines.append("  next best:")
        w = max(len(o.describe()) for o in others)
        for o in others:
            peak = max(o.memory.values())
            lines.append(f"    {o.describe().ljust(w)}  {units.seconds(o.step_s):>9}  peak {units.size(peak)}")
    return "".join(f"# {line}".rstrip() + "\n" for line in lines) + "#\n"


def spec_text(spec: Spec, c: Candidate, ranked: list[Candidate], hardware: dict, caps: dict) -> str:
    """The user's spec with the candidate's placement in place of `placement: auto` (or where it
    was missing), their comments kept; the data dumped anew where --set changed it."""
    import yaml

    from placer.spec.load import load_text

    body = None
    try:
        with open(spec.file, encoding="utf-8") as f:
            raw = f.read()
        if load_text(raw, spec.file).data == spec.doc.data:
            body = _splice(raw, spec, placement_yaml(c, spec.model.inline))
    except (OSError, PlacerError):
        pass
    if body is None:  # stdin, or changed by --set: the data as loaded
        data = {k: v for k, v in spec.doc.data.items() if k not in ("placement", "pipeline")}
        body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100) + placement_yaml(c, spec.model.inline)
    top = header(spec, c, ranked, hardware, caps)
    first, _, rest = body.partition("\n")
    if first.startswith("# yaml-language-server"):
        return f"{first}\n{top}{rest}"
    return top + body


def relocate(text: str, spec: Spec, out_dir: str) -> str:
    """The spec text to be written into `out_dir`: its model and data files, relative to the spec's
    folder, named relative to `out_dir` instead (and so is the schema of a yaml-language-server
    modeline, for the editor)."""
    import os
    import re

    here = os.path.dirname(os.path.abspath(spec.file))
    line = re.search(r"^# yaml-language-server: \$schema=(\S+)", text, re.M)
    if line and "://" not in line.group(1) and not os.path.isabs(line.group(1)):
        moved = os.path.relpath(os.path.join(here, line.group(1)), os.path.abspath(out_dir))
        text = text.replace(line.group(0), f"# yaml-language-server: $schema={moved}", 1)
    for ref in (spec.model.module, spec.training.data.module):
        if ref and ".py:" in ref and not os.path.isabs(ref.rsplit(":", 1)[0]):
            path, _, attr = ref.rpartition(":")
            moved = os.path.relpath(os.path.join(here, path), os.path.abspath(out_dir))
            text = text.replace(f"module: {ref}", f"module: {moved}:{attr}")
    return text


def _splice(raw: str, spec: Spec, block: str) -> str:
    lines = raw.splitlines(keepends=True)
    if "placement" in spec.doc.data:  # `placement: auto`, a scalar on its key's line
        at = spec.doc.key_loc(("placement",)).line - 1
        del lines[at]
    else:
        at = spec.doc.key_loc(("training",)).line - 1
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines[:at]) + block + "".join(lines[at:])
