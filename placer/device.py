"""A device name of the spec (`cpu`, `cpu:1`, `cuda:0`, `node1/cuda:0`) as a value.

The one parser of device names outside the generated program: node, type, index,
whether it is a host CPU, and which CPU a `via_host` copy goes through.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

_NAME = re.compile(r"(node(\d+)/)?(cpu|cuda)(?::(\d+))?")  # the schema's device_name, less strict


@dataclass(frozen=True)
class Device:
    node: int
    """The machine: K of a `nodeK/` prefix, 0 without one."""
    type: str
    """`cpu` or `cuda`, as torch.device names it."""
    index: int | None
    prefix: str = field(default="", compare=False)
    """The node prefix as written (`node1/`, `node0/` or none): `node0/cuda:0` is `cuda:0`."""

    @staticmethod
    @functools.cache
    def parse(name: str) -> Device:
        m = _NAME.fullmatch(name)
        if m is None:
            raise ValueError(f"not a device name: {name!r}")
        return Device(node=int(m[2] or 0), type=m[3], index=None if m[4] is None else int(m[4]), prefix=m[1] or "")

    @property
    def local(self) -> str:
        """The name on its own machine, without the node prefix: what torch.device takes."""
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def is_host(self) -> bool:
        """A CPU worker (`cpu`, `cpu:N`), not an accelerator."""
        return self.type == "cpu"

    @property
    def host(self) -> str:
        """The CPU of this device's machine, named with the same prefix: where a via_host copy
        from this device stages (`cpu` for `cuda:1`, `node1/cpu` for `node1/cuda:0`)."""
        return f"{self.prefix}cpu"
