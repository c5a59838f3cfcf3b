"""The shipped torch name lists equal what the installed torch has.

When this fails after a torch upgrade, run `python scripts/gen_torch_names.py`
and review the diff of `placer/spec/torch_names.py`.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.optim as optim  # noqa: E402
from torch.nn.modules.batchnorm import _BatchNorm  # noqa: E402
from torch.nn.modules.conv import _ConvNd  # noqa: E402
from torch.nn.modules.dropout import _DropoutNd  # noqa: E402
from torch.nn.modules.loss import _Loss  # noqa: E402

from placer.spec import torch_names  # noqa: E402

REGEN = "out of date with the installed torch: run `python scripts/gen_torch_names.py`"


def _public_subclasses(namespace, base) -> set[str]:
    return {
        name
        for name in dir(namespace)
        if not name.startswith("_")
        and inspect.isclass(getattr(namespace, name))
        and issubclass(getattr(namespace, name), base)
        and getattr(namespace, name) is not base
    }


def test_nn_modules_match_installed_torch():
    assert torch_names.NN_MODULES == _public_subclasses(nn, nn.Module), REGEN
    assert "Module" not in torch_names.NN_MODULES
    assert {"Linear", "Conv2d", "ReLU", "TransformerEncoderLayer"} <= torch_names.NN_MODULES


def test_nn_losses_match_installed_torch():
    assert torch_names.NN_LOSSES == _public_subclasses(nn, _Loss), REGEN
    assert {"CrossEntropyLoss", "MSELoss"} <= torch_names.NN_LOSSES
    assert torch_names.NN_LOSSES <= torch_names.NN_MODULES


def test_optimizers_match_installed_torch():
    assert torch_names.OPTIMIZERS == _public_subclasses(optim, optim.Optimizer), REGEN
    assert "Optimizer" not in torch_names.OPTIMIZERS
    assert {"SGD", "Adam", "AdamW"} <= torch_names.OPTIMIZERS


def test_lr_schedulers_match_installed_torch():
    from torch.optim import lr_scheduler

    assert torch_names.LR_SCHEDULERS == _public_subclasses(lr_scheduler, lr_scheduler.LRScheduler), REGEN
    assert {"CosineAnnealingLR", "StepLR", "LinearLR"} <= torch_names.LR_SCHEDULERS


def test_version_header_names_installed_torch():
    assert torch_names.TORCH_VERSION == torch.__version__, REGEN


def test_module_does_not_import_torch():
    """`placer validate` must stay torch-free: the module imports nothing but __future__."""
    tree = ast.parse(Path(torch_names.__file__).read_text(encoding="utf-8"))
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert all(name == "__future__" for name in imported), imported


def test_kinds_name_real_modules():
    assert set(torch_names.NN_MODULE_KINDS) <= torch_names.NN_MODULES


@pytest.mark.parametrize(
    ("kind", "base"),
    [("conv", _ConvNd), ("batchnorm", _BatchNorm), ("linear", nn.Linear)],
)
def test_kinds_agree_with_torch_classes(kind, base):
    for name, k in torch_names.NN_MODULE_KINDS.items():
        if k == kind:
            assert issubclass(getattr(nn, name), base), name


def test_every_dropout_class_has_kind_dropout():
    dropouts = _public_subclasses(nn, _DropoutNd)
    assert dropouts, "torch.nn has no _DropoutNd subclasses?"
    for name in dropouts:
        assert torch_names.NN_MODULE_KINDS.get(name) == "dropout", name


ARGS = {"Threshold": (0.1, 0.0)}  # classes with required constructor arguments


def test_elementwise_kinds_have_no_parameters_and_keep_shape():
    x = torch.randn(2, 3, 4)
    for name, kind in torch_names.NN_MODULE_KINDS.items():
        if kind != "elementwise":
            continue
        layer = getattr(nn, name)(*ARGS.get(name, ()))
        assert not list(layer.parameters()), name
        assert layer(x).shape == x.shape, name


def test_adaptive_pools_have_no_kind():
    for name in torch_names.NN_MODULES:
        if name.startswith("Adaptive"):
            assert name not in torch_names.NN_MODULE_KINDS, name
