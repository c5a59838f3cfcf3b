"""Layer selectors: `fc1` (a name, or the module subtree under it),
`block.0..block.3` (inclusive range in model order), `block.*` (glob)."""
from __future__ import annotations

from fnmatch import fnmatchcase

_GLOB = set("*?[")


def is_range(text: str) -> bool:
    return ".." in text


def is_glob(text: str) -> bool:
    return bool(_GLOB & set(text))


def match(text: str, names: list[str]) -> list[int] | str:
    """Indices (in model order) that `text` selects, or an error message."""
    if is_range(text):
        a, _, b = text.partition("..")
        ia, ib = _first(a, names), _last(b, names)
        if ia is None or ib is None:
            missing = a if ia is None else b
            return f"range end {missing!r} names no layer"
        if ia > ib:
            return f"range {text!r} runs backwards (model order is {names[ib]!r} before {names[ia]!r})"
        return list(range(ia, ib + 1))
    if is_glob(text):
        hits = [i for i, n in enumerate(names) if fnmatchcase(n, text)]
        return hits or f"pattern {text!r} matches no layer"
    hits = [i for i, n in enumerate(names) if n == text or n.startswith(text + ".")]
    return hits or f"no layer is named {text!r}"


def _first(name: str, names: list[str]) -> int | None:
    hits = match(name, names) if not is_range(name) else None
    return hits[0] if isinstance(hits, list) else None


def _last(name: str, names: list[str]) -> int | None:
    hits = match(name, names) if not is_range(name) else None
    return hits[-1] if isinstance(hits, list) else None
