"""Stated capacities against the memory estimate: what `plan` warns about (W008) and what the
placement search prunes by (placer/search/)."""
from __future__ import annotations

from dataclasses import dataclass

from placer import units
from placer.diagnostics import Diagnostic
from placer.spec.types import Spec


@dataclass(frozen=True)
class Shortfall:
    device: str
    need: int
    """The plan's estimated peak on the device (`DeviceMemory.total_bytes`)."""
    memory: int
    """The device's stated memory."""

    @property
    def over(self) -> int:
        return self.need - self.memory


def memory_caps(spec: Spec) -> dict[str, int]:
    """device -> its stated memory in bytes, for the devices that state one."""
    return {d.name: d.memory for d in spec.device_specs if d.memory is not None}


def shortfalls(est, caps: dict[str, int]) -> list[Shortfall]:
    """The devices whose estimate exceeds their stated memory, the largest excess first."""
    out = [Shortfall(d, e.total_bytes, caps[d]) for d, e in est.per_device.items()
           if d in caps and e.total_bytes > caps[d]]
    return sorted(out, key=lambda s: -s.over)


def over_capacity(spec: Spec, est) -> list[Diagnostic]:
    """W008 for each device of a written plan that exceeds the memory its entry states."""
    locs = {d.name: d.loc for d in spec.device_specs}
    return [Diagnostic("W008", f"device {s.device!r} is estimated to need {units.size(s.need)}, "
                       f"{units.size(s.over)} over the {units.size(s.memory)} its entry states", locs[s.device],
                       "shard (shard: optimizer / full), recompute, more stages or devices, a smaller batch; "
                       "or `placer suggest` for a plan that fits", severity="warning")
            for s in shortfalls(est, memory_caps(spec))]
