"""`placer init --model REF`: the `model:` section and placeable layers of a user's model.

Builds the model on the meta device through the same path as `plan --deep` (so it runs
the user's code), guesses input, target and loss from its first and last layers, and traces
it with that guess to get the layers in the order forward calls them. What cannot be
guessed is left as a commented line to edit.
"""
from __future__ import annotations

import dataclasses
import os

import yaml
from torch import nn

from placer.diagnostics import Loc, SpecError
from placer.spec import check
from placer.spec.starter import Model


def _ref_for(ref: str, spec_path: str) -> str:
    """A `file.py:Name` given relative to here, rewritten relative to the spec (as SPEC.md reads it)."""
    target, colon, name = ref.rpartition(":")
    if not target.endswith(".py") or os.path.isabs(target):
        return ref
    rel = os.path.relpath(os.path.abspath(target), os.path.dirname(os.path.abspath(spec_path)))
    return f"{rel.replace(os.sep, '/')}{colon}{name}"


SEQ_KWARGS = ("seq", "seq_len", "block_size", "max_seq_len", "context_length", "n_positions")


def _blocks(module: nn.Module) -> str | None:
    """The path of the model's blocks: its ModuleList (or Sequential) of two or more with the most
    parameters (Llama's `model.layers`, BERT's `bert.encoder.layer`), placed one by one."""
    lists = [(sum(p.numel() for p in m.parameters()), path) for path, m in module.named_modules()
             if path and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    return max(lists)[1] if lists else None


def _config_int(module: nn.Module, *names: str) -> int | None:
    """An int a Hugging Face model's config holds (its sizes are there, not in kwargs)."""
    cfg = getattr(module, "config", None)
    return next((v for n in names if isinstance(v := getattr(cfg, n, None), int) and not isinstance(v, bool)), None)


def _io_lines(module: nn.Module, kwargs: dict) -> tuple[list[str], list[str]]:
    """(input/target/loss lines, notes) guessed from the first and last layers with parameters,
    and from a Hugging Face config's sizes (the positions it has, the image size it takes)."""
    most = _config_int(module, "max_position_embeddings", "n_positions")
    seq = next((kwargs[k] for k in SEQ_KWARGS if isinstance(kwargs.get(k), int)), min(64, most or 64))
    leaves = [m for m in module.modules() if not list(m.children()) and any(True for _ in m.parameters(False))]
    first, last = (leaves[0], leaves[-1]) if leaves else (None, None)
    notes = []
    if isinstance(first, nn.Embedding):
        x = f"{{shape: [B, {seq}], dtype: int64, high: {first.num_embeddings}}}   # token ids; {seq}: the sequence length"
    elif isinstance(first, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        size = _config_int(module, "image_size")
        spatial = ", ".join([str(size or 32)] * (first.weight.dim() - 2))
        x = f"{{shape: [B, {first.in_channels}, {spatial}]}}" + ("   # the config's image_size" if size else
                                                                "   # 32: a guessed image size")
    elif isinstance(first, nn.Linear):
        x = f"{{shape: [B, {first.in_features}]}}"
    else:
        x = "{shape: [B, 1]}"
        notes.append("model.input is a placeholder: write the shape the model's forward takes")
    classes = last.out_features if isinstance(last, nn.Linear) else None
    if classes is None:
        notes.append("model.target and model.loss are placeholders: write what the loss compares")
        y = "{shape: [B]}"
    elif isinstance(first, nn.Embedding):
        y = f"{{shape: [B, {seq}], dtype: int64, high: {classes}}}   # next-token ids"
    else:
        y = f"{{shape: [B], dtype: int64, high: {classes}}}   # class indices in [0, {classes})"
    loss = "CrossEntropyLoss" if classes is not None else "MSELoss"
    return [f"  input: {x}", f"  target: {y}", f"  loss: {loss}"], notes


def _spec(lines: list[str], file: str, blocks: str | None = None):
    # the selectors choose the layers' depth: `blocks.*` opens the parents of the model's blocks
    opened = f", '{blocks}.*'" if blocks else ""
    text = "\n".join(["placer: 1", "name: probe", *lines, "devices: [cpu]",
                      f"placement: [{{layers: ['*'{opened}], device: cpu}}]",
                      "training: {batch_size: 2, steps: 1, optimizer: {op: SGD, lr: 0.1}}", ""])
    return check.load_spec_text(text, file)


def module_model(ref: str, spec_path: str, kwargs: dict) -> Model:
    """Build `ref` on meta; its model lines, placeable layers (in forward's order when the guessed
    input runs) and their parameter counts. SpecError (located at `--model REF`) on failure."""
    from placer.model import build

    where = Loc(f"--model {ref}")
    head = ["model:", f"  module: {_ref_for(ref, spec_path)}   # a class, or a function returning an nn.Module",
            f"  kwargs: {yaml.safe_dump(kwargs, default_flow_style=True, sort_keys=False, width=1 << 16).strip()}   # passed to it"]
    try:
        probe = _spec(head + ["  input: {shape: [B, 1]}", "  target: {shape: [B]}", "  loss: MSELoss"], spec_path)
        module = build.build_module(probe)
    except SpecError as e:  # the spec is not written yet: the option is the place to fix
        raise SpecError([dataclasses.replace(d, loc=where) for d in e.diagnostics]) from None
    io, notes = _io_lines(module, kwargs)
    blocks = _blocks(module)
    try:
        try:
            graph = build.build_graph(_spec(head + io, spec_path, blocks), module)
        except SpecError as e:  # a ModelOutput (HF): the loss takes its first tensor field, as M008 says
            field = next((d.hint.rpartition("(output: ")[2].rstrip(")") for d in e.diagnostics
                          if d.code == "M008" and d.hint and "(output: " in d.hint), None)
            if field is None:
                raise
            io = [f"  output: {field}   # the field of forward's output the loss takes", *io]
            graph = build.build_graph(_spec(head + io, spec_path, blocks), module)
        names, params = graph.names, [layer.params for layer in graph.layers]
    except SpecError as e:  # the guess did not run: definition order, and say why
        names = build.placeable_layers(module, selectors=[f"{blocks}.*"] if blocks else ())
        params = [sum(p.numel() for p in module.get_submodule(n).parameters()) for n in names]
        notes.append(f"forward did not run with the guessed input ({e.diagnostics[0].message}); "
                     "layers are in definition order: check model.input and the placement's order")
    return Model(head + io, names, params, notes, sibling_ranges=True)
