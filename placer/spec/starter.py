"""`placer init`: a commented starter spec that validates as written, for the user to edit.

Torch-free: the layers and their parameter counts come in as plain values (inline
layers below, or `placer.model.starter` for a user's model).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from placer.spec import schema

# A small MLP on 784 features and 10 classes (MNIST-sized): (name, op, args, parameters).
INLINE_LAYERS = [
    ("fc1", "Linear", [784, 256], 784 * 256 + 256),
    ("act1", "ReLU", [], 0),
    ("fc2", "Linear", [256, 256], 256 * 256 + 256),
    ("act2", "ReLU", [], 0),
    ("head", "Linear", [256, 10], 256 * 10 + 10),
]


@dataclass
class Model:
    """What init knows of the model: its `model:` lines and its placeable layers in model order."""

    lines: list[str]
    names: list[str]
    params: list[int]
    notes: list[str] = field(default_factory=list)
    sibling_ranges: bool = False  # module models: a range's ends should be siblings (SPEC.md)


def spec_name(text: str) -> str:
    """A valid spec name made from a file stem or a class name."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", text).strip("-") or "starter"
    return name if re.match(r"[A-Za-z_]", name) else f"m_{name}"


def balance(params: list[int], k: int) -> list[tuple[int, int]]:
    """Cut layers into at most k contiguous runs [start, end) of about equal parameter counts.
    Each cut goes where the running total is closest to its share; on a tie, the later place,
    so that a parameter-free layer (ReLU) stays with the layer before it."""
    n, k = len(params), max(1, min(k, len(params)))
    prefix = [0]
    for p in params:
        prefix.append(prefix[-1] + p)
    cuts, start = [], 0
    for j in range(1, k):
        target = prefix[-1] * j / k
        options = range(start + 1, n - (k - j) + 1)
        cut = min(options, key=lambda i: (abs(prefix[i] - target), -i))
        cuts.append(cut)
        start = cut
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:]))


def _selectors(names: list[str], siblings: bool) -> list[str]:
    """`first..last` for a run of layers; for module models, one range per run of siblings."""
    if not siblings:
        return [names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"]
    runs: list[list[str]] = []
    for n in names:
        if runs and runs[-1][-1].rpartition(".")[0] == n.rpartition(".")[0]:
            runs[-1].append(n)
        else:
            runs.append([n])
    return [r[0] if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs]


def _flow(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) if not re.fullmatch(r"[A-Za-z_][\w.:/-]*", i) else i for i in items) + "]"


def inline_model() -> Model:
    lines = ["model:",
             "  # Inline torch.nn layers, run in order (no user code runs). To place your own model instead:",
             "  #   module: models/net.py:Net    # a class, or a function returning an nn.Module",
             "  #   kwargs: {width: 256}          # passed to it",
             "  # (`placer init --model models/net.py:Net` writes that spec for you.)",
             "  layers:"]
    lines += [f"    - {{name: {n}, op: {op}" + (f", args: {args}" if args else "") + "}"
              for n, op, args, _ in INLINE_LAYERS]
    lines += ["  input: {shape: [B, 784]}                      # B is training.batch_size",
              "  target: {shape: [B], dtype: int64, high: 10}  # class indices in [0, 10)",
              "  loss: CrossEntropyLoss                        # a torch.nn loss class"]
    return Model(lines, [n for n, *_ in INLINE_LAYERS], [p for *_, p in INLINE_LAYERS])


def render(name: str, model: Model, devices: list[str], folder: str | None = None) -> str:
    """The starter spec's text: header, model, devices, a balanced placement, training. The
    modeline names the schema relative to the spec's `folder` (so the spec and its checkout or
    environment move together, as the shipped specs' `../schemas/...`); printed (None), absolute."""
    import os

    runs = balance(model.params, len(devices))
    used = devices[:len(runs)]
    where = str(schema.schema_path())
    if folder is not None:
        where = os.path.relpath(where, os.path.abspath(folder))
    out = [f"# yaml-language-server: $schema={where}",
           "# A placer spec: where every layer of a model runs. Next steps:",
           "#   placer validate SPEC            check it (file:line:col errors)",
           "#   placer plan SPEC                memory, communication and FLOPs per device",
           "#   placer run SPEC --check         train it (missing devices run as CPU workers) and compare",
           "#                                   with the whole model on one device",
           "# The language: docs/spec.md; `placer schema` prints the JSON Schema.",
           "placer: 1",
           f"name: {name}                  # names the program, the diagrams and the run directory",
           ""]
    out += model.lines + [""]
    out += [f"devices: {_flow(used)}   # one worker (rank) per device; `cpu`, `cuda:N`, `node1/cuda:0`", ""]
    total = sum(model.params) or 1
    out += ["# Ordered segments that together hold every layer once, in model order. This placement",
            f"# balances parameters over the devices ({len(runs)} segment{'s' if len(runs) != 1 else ''}); edit it.",
            "# A segment on several devices takes a mode, e.g.",
            "#   - {layers: ..., devices: [cuda:0, cuda:1], parallel: data}    # DDP",
            "#   parallel: {mode: data, shard: full}    # FSDP / ZeRO-3; shard: optimizer is ZeRO-1",
            "#   parallel: tensor    # Megatron-style Linear pairs; also channel, spatial",
            "# and a top-level `pipeline: {microbatches: 8, schedule: 1f1b}` runs the segments as stages.",
            "placement:"]
    for i, ((a, b), device) in enumerate(zip(runs, used)):
        share = sum(model.params[a:b])
        sel = _selectors(model.names[a:b], model.sibling_ranges)
        layers = sel[0] if len(sel) == 1 else _flow(sel)
        if not re.fullmatch(r"[A-Za-z_][\w.:-]*", layers) and not layers.startswith("["):
            layers = json.dumps(layers)
        out.append(f"  - {{name: s{i}, layers: {layers}, device: {device}}}   # {share:,} parameters "
                   f"({share / total:.0%})")
    out += ["",
            "training:",
            "  batch_size: 32             # the global batch",
            "  steps: 20",
            "  optimizer: {op: SGD, lr: 0.05}   # any torch.optim class; kwargs: {momentum: 0.9}",
            "  seed: 0",
            "  # data: {module: data.py:batches}   # default: synthetic batches from model.input / target",
            ""]
    if len(used) < len(devices):
        model.notes.append(f"{len(model.names)} layers fill only {len(used)} of the {len(devices)} devices")
    out[7:7] = [f"# note: {n}" for n in model.notes]
    return "\n".join(out)
