"""What binds a run directory to the spec it was trained with: RUN_DIR/spec.yaml is the
effective spec (the file after every `--set` and `--steps`), RUN_DIR/fingerprint.json the
values a resume must keep. A resume that changes the computation is R033 naming what differs."""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from placer.diagnostics import Diagnostic, RunError
from placer.spec.load import Document

FINGERPRINT = "fingerprint.json"
# What a resume may change: how long it trains, when it saves, how it loads data ahead and how
# the workers are run. Everything else changes what one step computes.
FREE = ("placer", "name", "description", "training.steps", "training.checkpoint", "training.prefetch", "runtime")
# Where the model's state lives: a resume may change it when both layouts can be resharded
# (the program loads the checkpoint by the model's names through torch.distributed.checkpoint).
PLACED = ("devices", "placement", "pipeline", "copies")
SHOWN = 6  # differing keys named in full
EARLIER = "they were written by an earlier placer, as each rank's pieces only"


def effective_spec(doc: Document, raw: bytes, overrides=(), steps: int | None = None) -> tuple[dict, str]:
    """(the spec's data as it trains, RUN_DIR/spec.yaml's text): the file's own text when nothing
    overrides it (its comments kept), else the data written out with a header saying how."""
    changes = [f"--set {o}" for o in overrides] + ([f"--steps {steps}"] if steps else [])
    data = doc.data
    if steps:
        data = copy.deepcopy(data)
        data.setdefault("training", {})["steps"] = steps
    if not changes:
        return data, raw.decode("utf-8")
    header = f"# the spec as trained: {doc.file} with {' '.join(changes)}\n"
    return data, header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120, default_flow_style=None)


def must_match(data: dict) -> dict[str, Any]:
    """The values a resume must keep, by dotted path (`training.batch_size`, `placement.0.device`);
    training's defaults filled in, so that writing one out is no change."""
    from placer.spec.schema import schema

    training = schema()["$defs"]["training"]["properties"]
    data = copy.deepcopy(data)
    section = data.get("training")
    if isinstance(section, dict):
        for key, prop in training.items():
            if prop.get("default") is not None:
                section.setdefault(key, prop["default"])
    flat: dict[str, Any] = {}
    _flatten(data, "", flat)
    kept = {k: v for k, v in flat.items() if not any(k == f or k.startswith(f + ".") for f in FREE)}
    return _normal(json.loads(json.dumps(kept, default=str)))  # as fingerprint.json reads back


def _normal(flat: dict) -> dict:
    """`parallel: data` as `parallel: {mode: data}`, so that writing one for the other is no change."""
    return {f"{k}.mode" if k.endswith(".parallel") and isinstance(v, str) else k: v for k, v in flat.items()}


def _flatten(value, prefix: str, out: dict) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}{key}.", out)
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):  # placement, layers: by index
        for i, item in enumerate(value):
            _flatten(item, f"{prefix}{i}.", out)
    else:  # a scalar or a list of them (devices, args)
        out[prefix[:-1]] = value


def digest(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def record_fingerprint(run_dir: Path, data: dict, reshard: str | None = None) -> None:
    """Write RUN_DIR/fingerprint.json for the spec in `data`; `reshard`: why its program's
    checkpoints cannot be resharded (None: they can)."""
    from placer.launch.run import write_atomically

    values = must_match(data)
    write_atomically(run_dir / FINGERPRINT, json.dumps({"sha256": digest(values), "must_match": values,
                                                         "reshard": reshard}, indent=2))


def placed(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in PLACED)


def differences(run_dir: Path, data: dict) -> list[str] | None:
    """`key: before -> now` for each value a resume must keep that `data` changes; None when the
    run directory has no fingerprint (an earlier placer made it)."""
    try:
        before = _normal(json.loads((run_dir / FINGERPRINT).read_text())["must_match"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    now = must_match(data)
    if digest(now) == digest(before):
        return []
    keys = list(before) + [k for k in now if k not in before]  # in the spec's order
    return [f"{k}: {_show(before.get(k))} -> {_show(now.get(k))}" for k in keys if before.get(k) != now.get(k)]


def resume_changes(run_dir: Path, doc: Document, data: dict, anyway: bool,
                   reshard: str | None = None) -> tuple[list[str], list[str]]:
    """(the differences a resume goes on with, those of them in the placement): a placement the
    checkpoint is resharded into (`reshard`: why the new program's cannot be, None: it can),
    and with `anyway` (--resume-anyway) any other. R033 otherwise, located at the first key."""
    changed = differences(run_dir, data) or []
    moved = [c for c in changed if placed(_key(c))]
    rest = [c for c in changed if not placed(_key(c))]
    if rest and not anyway:
        more = f" and {len(rest) - SHOWN} more" if len(rest) > SHOWN else ""
        raise RunError(Diagnostic(
            "R033", f"the spec differs from the one the run in {run_dir} trained with, in what changes the "
            f"computation: {'; '.join(rest[:SHOWN])}{more}", doc.key_loc(_path(rest[0])),
            f"resume with the spec as trained ({run_dir / 'spec.yaml'}); only {', '.join(FREE[3:])} may change, "
            "and the placement where its checkpoints can be resharded. "
            "Or pass --resume-anyway to continue from the checkpoint with the new values"))
    if moved:
        try:
            before = json.loads((run_dir / FINGERPRINT).read_text()).get("reshard", EARLIER)
        except (OSError, ValueError, AttributeError):
            before = EARLIER
        why = f"as trained, {before}" if before else f"under the new placement, {reshard}" if reshard else None
        if why:
            more = f" and {len(moved) - SHOWN} more" if len(moved) > SHOWN else ""
            raise RunError(Diagnostic(
                "R033", f"the placement differs from the one the run in {run_dir} trained with "
                f"({'; '.join(moved[:SHOWN])}{more}) and its checkpoints cannot be resharded: {why}",
                doc.key_loc(_path(moved[0])),
                f"resume with the placement as trained ({run_dir / 'spec.yaml'}), or start a new run. Checkpoints "
                "reshard between placements of whole layers, DDP replicas, FSDP2 shards and pipeline stages"))
    return changed, moved


def _key(change: str) -> str:
    return change.split(": ")[0]


def _path(change: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in _key(change).split("."))


def _show(value) -> str:
    if value is None:
        return "(not set)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value)
