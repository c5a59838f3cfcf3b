"""torch is an optional extra (plain `placer validate` never needs it): say how to get it
instead of letting a ModuleNotFoundError traceback reach the user."""
from __future__ import annotations

INSTALL = "pip install 'placer[torch]'"


class MissingDependency(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the command to install it."""


def is_missing_torch(e: BaseException) -> bool:
    """True for the ImportError of a missing torch (or of numpy, which torch and the programs need)."""
    return isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in ("torch", "numpy")


def require_torch(what: str) -> None:
    """Raise MissingDependency ("<what> needs PyTorch: pip install ...") unless torch imports."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as e:
        if not is_missing_torch(e):
            raise
        raise MissingDependency(f"{what} needs PyTorch: {INSTALL}", name="torch") from None
