"""placer: place every layer of a PyTorch model on devices, from one YAML spec.

    import placer
    spec = placer.load("spec.yaml")            # the validated Spec (SpecError if not valid)
    report = placer.plan(spec)                 # .table(), .to_json(), .svg(); shows as a graph in Jupyter
    source = placer.generate(spec, "prog.py")  # the standalone torch program
    found = placer.suggest("spec.yaml")        # placement: auto -> the fastest plan that fits; .text, .best

Importing placer does not import torch; plan and generate do.
"""
import sys
import types

__version__ = "0.1.0"

from placer.api import generate, load, plan, suggest  # noqa: E402
from placer.diagnostics import PlanError, SpecError  # noqa: E402

__all__ = ["load", "plan", "generate", "suggest", "SpecError", "PlanError", "__version__"]


class _Package(types.ModuleType):
    """Importing the subpackage `placer.plan` would rebind `placer.plan` to it, hiding the function;
    keep the function (the subpackage stays importable: `from placer.plan import ir`)."""

    def __setattr__(self, name, value):
        if name == "plan" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
