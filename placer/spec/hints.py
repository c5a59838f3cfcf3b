"""Hints for the words users bring from other tools (DDP, FSDP, ZeRO, Megatron, torchrun)
and from YAML's habits, so that an error points at placer's own word for the same thing."""
from __future__ import annotations

import re

_PIPELINE = ("a pipeline is not a segment mode: give each stage its own segment (its own device) and add a "
             "top-level section `pipeline: {microbatches: 8, schedule: 1f1b}`")
_ZERO2 = ("placer has no ZeRO-2: `shard: optimizer` is ZeRO-1 (optimizer state sharded), `shard: full` is "
          "ZeRO-3 / FSDP (parameters, gradients and optimizer state sharded); pick one")

# What a parallel mode is called elsewhere -> what to write in placer.
MODES = {
    "ddp": "DDP is placer's `data`: parallel: data (gradients all-reduced, as DDP does)",
    "dp": "data parallelism is placer's `data`: parallel: data",
    "distributeddataparallel": "DDP is placer's `data`: parallel: data",
    "fsdp": "FSDP is `data` with full sharding: parallel: {mode: data, shard: full}",
    "fsdp2": "FSDP is `data` with full sharding: parallel: {mode: data, shard: full}",
    "zero3": "ZeRO-3 is `data` with full sharding: parallel: {mode: data, shard: full}",
    "zero": "ZeRO-1 is `data` with its optimizer state sharded: parallel: {mode: data, shard: optimizer}",
    "zero1": "ZeRO-1 is `data` with its optimizer state sharded: parallel: {mode: data, shard: optimizer}",
    "zero2": _ZERO2 + ", with parallel: {mode: data, shard: ...}",
    "tp": "tensor parallelism is placer's `tensor`: parallel: tensor (Megatron-style column/row Linear pairs)",
    "megatron": "Megatron-style tensor parallelism is placer's `tensor`: parallel: tensor",
    "pp": _PIPELINE,
    "pipeline": _PIPELINE,
}
SHARDS = {
    "zero": "ZeRO-1 is `shard: optimizer` (optimizer state sharded)",
    "zero1": "ZeRO-1 is `shard: optimizer` (optimizer state sharded)",
    "zero2": _ZERO2,
    "zero3": "ZeRO-3 is `shard: full` (parameters, gradients and optimizer state sharded, as FSDP2 does)",
    "fsdp": "FSDP is `shard: full` (parameters, gradients and optimizer state sharded)",
    "full_shard": "FSDP's FULL_SHARD is `shard: full`",
    "shard_grad_op": _ZERO2,
    "no_shard": "FSDP's NO_SHARD is `shard: none` (plain data parallelism)",
}
# Where a class name is looked up, by the key that names it.
_NAMESPACES = {"torch.nn": "torch.nn", "nn": "torch.nn", "torch.optim": "torch.optim", "optim": "torch.optim",
               "torch.optim.lr_scheduler": "torch.optim.lr_scheduler", "lr_scheduler": "torch.optim.lr_scheduler"}
_DOTTED = re.compile(r"^(?P<ns>[A-Za-z_][\w.]*)\.(?P<name>[A-Za-z_]\w*)$")


def _fold(word: str) -> str:
    return re.sub(r"[-_ ]", "", word.lower())  # ZeRO-1, zero_1 -> zero1


def for_value(path: tuple, value) -> str | None:
    """A hint for a value written in another tool's words, or None."""
    if not isinstance(value, str) or not path:
        return None
    key = path[-1]
    if key in ("parallel", "mode"):
        return MODES.get(_fold(value))
    if key == "shard":
        return SHARDS.get(value.lower()) or SHARDS.get(_fold(value))
    m = _DOTTED.match(value)
    if m and m["ns"] in _NAMESPACES:
        return f"write {m['name']!r}: placer looks class names up in {_NAMESPACES[m['ns']]} itself"
    return None


def quote_boolean(raw: str | None, path: tuple) -> str | None:
    """YAML 1.1 reads unquoted yes/no/on/off/true/false as booleans: say so where a string was meant."""
    if raw is None:
        return None
    key = path[-1] if path and isinstance(path[-1], str) else "the value"
    value = "true" if raw.lower() in ("yes", "true", "on") else "false"
    return f'YAML 1.1 reads an unquoted {raw} as {value}: quote it to keep the text ({key}: "{raw}")'
