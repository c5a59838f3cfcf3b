"""No parallel mode: the segment runs whole on its one device (layer-wise placement).

Every `Mode` default is this mode's answer; what it adds is the copies between devices,
which lowering places from the layouts of consecutive segments.
"""
from __future__ import annotations

from placer.modes.base import Mode

MODE = Mode()
