"""Build and trace on meta without importing what only torch.compile needs.

torch imports two heavy modules on the first call that asks for them, and a meta trace asks:

- `torch._dynamo` (sympy, FSDP, DTensor: 1.5-2 s): torch wraps its Python kernels (the meta
  device's linear, gelu, layer_norm, normal_, ...), every dispatch mode (FlopCounterMode) and
  torch.optim's constructor in `torch._disable_dynamo`, whose first call imports it only for
  `disable(fn)`, a wrapper that matters while torch.compile traces; torch.optim's step calls
  `graph_break()`, which does nothing outside a compile.
- sympy (0.5-1 s): every `torch._check` in a meta kernel imports symbolic_shapes (and so
  sympy) for `expect_true(cond)`, which is `cond` itself for a plain bool; the kernels' other
  shape helpers likewise only do work for symbolic sizes; type promotion imports sympy only to
  ask whether an argument is a `sympy.Basic`, which nothing is before sympy is imported.

`defer_compile_imports()` stands light modules in for them while placer builds and traces:
their functions answer for plain values (a meta trace has no symbolic sizes) and hand anything
else, like any other attribute, to the real module, which is imported then. On exit torch is as
it was.
"""
from __future__ import annotations

import contextlib
import importlib
import operator
import sys
import types
from functools import reduce

DYNAMO = "torch._dynamo"
SHAPES = "torch.fx.experimental.symbolic_shapes"


def _real(name: str) -> types.ModuleType:
    stand_in = sys.modules.get(name)
    if isinstance(stand_in, _StandIn):  # from now on it answers as the real module does
        stand_in.active = False
        del sys.modules[name]
    return importlib.import_module(name)


class _StandIn(types.ModuleType):
    """Answers `light` names while active; anything else (and everything after) from the real module."""

    def __init__(self, name: str, package: bool, light: dict):
        super().__init__(name)
        self.package, self.light, self.active = package, light, True

    def __getattr__(self, name: str):
        if self.active and name in self.light:
            return self.light[name]
        if name.startswith("__") and not (name == "__path__" and self.package):  # module probes: no need to load
            raise AttributeError(name)
        return getattr(_real(self.__name__), name)


class _NoSympyObject:
    """sympy.Basic while sympy is not imported: no value is one (torch asks in type promotion)."""


def _plain(a) -> bool:
    return type(a) in (bool, int) or isinstance(a, (list, tuple)) and all(map(_plain, a))


def _bools(*args) -> bool:
    return all(type(a) is bool for a in args)


def _shape_helper(name: str, answer, plain=_bools):
    """`name` of symbolic_shapes: `answer` for plain arguments, else the real function."""
    def helper(*args, **kwargs):
        if plain(*args):
            return answer(*args, **kwargs)
        return getattr(_real(SHAPES), name)(*args, **kwargs)
    return helper


def _sym_eq(x, y) -> bool:
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(map(_sym_eq, x, y))
    return x == y


def _shape_helpers() -> dict:
    same = {name: _shape_helper(name, lambda a, *_: a) for name in (
        "expect_true", "guard_bool", "guard_size_oblivious", "guard_or_false", "guard_or_true",
        "statically_known_true")}
    return same | {
        "guarding_hint_or_throw": _shape_helper("guarding_hint_or_throw", lambda a: a, plain=_plain),
        "has_guarding_hint": _shape_helper("has_guarding_hint", lambda a: True, plain=_plain),
        "is_nested_int": _shape_helper("is_nested_int", lambda a: False, plain=_plain),
        "sym_and": _shape_helper("sym_and", lambda *xs: reduce(operator.and_, xs)),
        "sym_or": _shape_helper("sym_or", lambda *xs: reduce(operator.or_, xs)),
        "sym_eq": _shape_helper("sym_eq", _sym_eq, plain=lambda x, y: _plain(x) and _plain(y)),
    }


@contextlib.contextmanager
def defer_compile_imports():
    """While placer builds, traces and tries the optimizer: neither torch._dynamo nor sympy is
    imported unless something really needs them. Functions that got themselves as their dynamo
    `disable` wrapper forget it on exit, so a later call (under torch.compile in the user's own
    process, say) gets torch's real wrapper."""
    given: list = []

    def disable(fn=None, recursive=True, **kwargs):
        if fn is None:  # the decorator form
            return _real(DYNAMO).disable(fn, recursive, **kwargs)
        given.append(fn)
        return fn

    stand_ins = {DYNAMO: _StandIn(DYNAMO, True, {"disable": disable, "graph_break": lambda *a, **k: None}),
                 SHAPES: _StandIn(SHAPES, False, _shape_helpers()),
                 "sympy": _StandIn("sympy", True, {"Basic": _NoSympyObject})}
    placed = {name: m for name, m in stand_ins.items() if name not in sys.modules}  # those paid already stay
    sys.modules.update(placed)
    try:
        yield
    finally:
        for name, stand_in in placed.items():
            stand_in.active = False  # a module that kept it gets the real one's answers from now on
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
            parent, _, attr = name.rpartition(".")
            if parent in sys.modules and vars(sys.modules[parent]).get(attr) is stand_in:
                delattr(sys.modules[parent], attr)
        for fn in given:
            if getattr(fn, "__dynamo_disable", None) is fn:
                del fn.__dynamo_disable
