"""Sizes and counts for people, and the byte units placer reckons in (binary: 1 MiB = 2**20 B)."""
from __future__ import annotations

KiB = 2 ** 10
MiB = 2 ** 20


def size(n: float) -> str:
    """Bytes for people: 512 B, 1.5 KiB, 3.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def si(n: float) -> str:
    """FLOPs and counts for people: 950, 12.3 K, 4.56 G."""
    for unit in ("", " K", " M", " G", " T"):
        if abs(n) < 1000:
            return f"{n:.0f}" if not unit else f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g} P"


def count(n: int, noun: str) -> str:
    """`1 layer`, `12 layers`, `1,024 parameters`."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def seconds(t: float) -> str:
    """Durations for people: 850 us, 16.9 ms, 1.23 s."""
    if abs(t) < 1e-3:
        return f"{t * 1e6:.0f} us"
    return f"{t * 1e3:.3g} ms" if abs(t) < 1 else f"{t:.3g} s"
