#!/usr/bin/env python
"""Generate `placer/spec/torch_names.py` from the installed torch.

Plain `placer validate` must not import torch, yet it checks that a layer's
`op`, the `loss` and the optimizer name real torch classes. This script
writes those names (and a hand-kept table of layer kinds used by the
semantic checks) into a plain module.

    python scripts/gen_torch_names.py           # rewrite the module
    python scripts/gen_torch_names.py --check   # exit 1 if it is out of date

`tests/unit/test_torch_names.py` fails when the installed torch no longer
matches the shipped lists; run this script then and review the diff.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "placer" / "spec" / "torch_names.py"

# Hand-kept: the kind of some torch.nn classes, as the semantic checks see
# them. A class that is not listed has no kind (placer treats it as opaque).
# Each kind is one string; a class that fits two kinds gets the one that
# matters most to placement (Dropout is elementwise, but its kind is
# "dropout" because that is what makes `data` parallel non-reproducible).
KINDS: dict[str, tuple[str, ...]] = {
    # y = x W^T + b: split by output features (channel) or Megatron pairs (tensor).
    "linear": ("Linear",),
    # Convolutions: channel split by output channels, spatial split with halos.
    "conv": ("Conv1d", "Conv2d", "Conv3d"),
    # Windowed pooling: spatial split with halos is exact. Adaptive pools are
    # left out on purpose: their windows depend on the whole input size.
    "pool": ("MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d"),
    # Pointwise and parameter-free: any split of the input is exact.
    "elementwise": (
        "CELU", "ELU", "GELU", "Hardshrink", "Hardsigmoid", "Hardswish", "Hardtanh",
        "Identity", "LeakyReLU", "LogSigmoid", "Mish", "ReLU", "ReLU6", "SELU", "SiLU",
        "Sigmoid", "Softplus", "Softshrink", "Softsign", "Tanh", "Tanhshrink", "Threshold",
    ),
    # Random in training mode: a `data` split draws different random numbers
    # than the one-device run, so results are not reproducible. RReLU (random
    # slope in training) belongs here too.
    "dropout": (
        "AlphaDropout", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d",
        "FeatureAlphaDropout", "RReLU",
    ),
    # Statistics over the batch: `data` matches one device only with
    # sync_batchnorm; per-channel, so a channel split is exact.
    "batchnorm": ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"),
    # Per-sample normalization over features/channels/space: exact under
    # `data`; not under a channel or spatial split of what they normalize.
    "norm": (
        "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
        "LayerNorm", "LocalResponseNorm", "RMSNorm",
    ),
    # Normalize over one dim (softmax family): not split along that dim.
    "softmax": ("LogSoftmax", "Softmax", "Softmax2d", "Softmin"),
    # Reshape of the non-batch dims.
    "flatten": ("Flatten", "Unflatten"),
    # Table lookup: integer input.
    "embedding": ("Embedding", "EmbeddingBag"),
    "attention": ("MultiheadAttention",),
    # Note: these have dropout=0.1 by default (a `dropout` kwarg), and
    # MultiheadAttention has a `dropout` kwarg too (default 0.0).
    "transformer": (
        "Transformer", "TransformerDecoder", "TransformerDecoderLayer",
        "TransformerEncoder", "TransformerEncoderLayer",
    ),
    "recurrent": ("GRU", "GRUCell", "LSTM", "LSTMCell", "RNN", "RNNCell"),
    # Hold other modules; not layers in their own right.
    "container": (
        "Container", "ModuleDict", "ModuleList", "ParameterDict", "ParameterList", "Sequential",
    ),
}


def collect() -> dict:
    """The name sets of the installed torch (sorted lists) and its version."""
    import torch
    import torch.nn as nn
    import torch.optim as optim
    import torch.optim.lr_scheduler as lr_scheduler
    from torch.nn.modules.loss import _Loss

    def classes(ns, base):
        out = []
        for name in dir(ns):
            if name.startswith("_"):
                continue
            obj = getattr(ns, name)
            if inspect.isclass(obj) and issubclass(obj, base) and obj is not base:
                out.append(name)
        return sorted(out)

    modules = classes(nn, nn.Module)
    return {
        "version": torch.__version__,
        "NN_MODULES": modules,
        "NN_LOSSES": [n for n in modules if issubclass(getattr(nn, n), _Loss)],
        "OPTIMIZERS": classes(optim, optim.Optimizer),
        "LR_SCHEDULERS": classes(lr_scheduler, lr_scheduler.LRScheduler),
    }


def _frozenset(name: str, doc: str, names: list[str]) -> str:
    body = "".join(f'        "{n}",\n' for n in names)
    return f"{name}: frozenset[str] = frozenset(\n    {{\n{body}    }}\n)\n{doc}\n"


def render(names: dict) -> str:
    modules = set(names["NN_MODULES"])
    kinds: dict[str, str] = {}
    for kind, members in KINDS.items():
        for n in members:
            if n not in modules:
                raise SystemExit(
                    f"gen_torch_names: KINDS[{kind!r}] names {n!r}, "
                    f"not a class in torch.nn {names['version']}"
                )
            if n in kinds:
                raise SystemExit(f"gen_torch_names: {n!r} has two kinds, {kinds[n]!r} and {kind!r}")
            kinds[n] = kind
    kind_lines = "".join(f'    "{n}": "{kinds[n]}",\n' for n in sorted(kinds))
    return (
        f"# Generated by scripts/gen_torch_names.py from torch {names['version']}. Do not edit by hand:\n"
        "# change the script (or upgrade torch) and run it again.\n"
        '"""Names of torch classes a spec may use, known without importing torch.\n'
        "\n"
        "Plain `placer validate` never imports torch; it checks `model.layers[].op`,\n"
        "`model.loss`, `training.optimizer.op` and `training.lr_schedule.op` against these sets.\n"
        '"""\n'
        "from __future__ import annotations\n"
        "\n"
        f'TORCH_VERSION = "{names["version"]}"\n'
        '"""The torch version these names were taken from."""\n'
        "\n"
        + _frozenset(
            "NN_MODULES",
            '"""Public classes in `torch.nn` that subclass `nn.Module` (`Module` itself excluded)."""',
            names["NN_MODULES"],
        )
        + "\n"
        + _frozenset(
            "NN_LOSSES",
            '"""Classes in `torch.nn` that subclass `torch.nn.modules.loss._Loss`."""',
            names["NN_LOSSES"],
        )
        + "\n"
        + _frozenset(
            "OPTIMIZERS",
            '"""Public classes in `torch.optim` that subclass `Optimizer` (`Optimizer` itself excluded)."""',
            names["OPTIMIZERS"],
        )
        + "\n"
        + _frozenset(
            "LR_SCHEDULERS",
            '"""Public classes in `torch.optim.lr_scheduler` that subclass `LRScheduler` (itself excluded)."""',
            names["LR_SCHEDULERS"],
        )
        + "\n"
        + "NN_MODULE_KINDS: dict[str, str] = {\n"
        + kind_lines
        + "}\n"
        + '"""The kind of some `torch.nn` classes, for the semantic checks (hand-kept in\n'
        "scripts/gen_torch_names.py). A class not listed has no kind: placer treats it\n"
        "as opaque. Kinds:\n"
        "\n"
        + "".join(
            textwrap.fill(f"- {k}: {', '.join(v)}", width=79, subsequent_indent="  ") + "\n"
            for k, v in KINDS.items()
        )
        + '"""\n'
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the module is out of date; write nothing"
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"output file (default {OUT})")
    args = parser.parse_args(argv)
    text = render(collect())
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date; run scripts/gen_torch_names.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
