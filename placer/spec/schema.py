"""Shape checks: the JSON Schema (the one source of truth for a spec's shape),
with jsonschema's errors turned into located, hinted diagnostics."""
from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError, best_match, relevance

from placer.diagnostics import Diagnostic, did_you_mean
from placer.spec import hints
from placer.spec.load import Document

SCHEMA_FILE = "placer-spec.schema.json"


def schema_path() -> str:
    """Where the installed schema file is (inside the package)."""
    return str(resources.files("placer").joinpath("schemas").joinpath(SCHEMA_FILE))


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(resources.files("placer").joinpath("schemas").joinpath(SCHEMA_FILE).read_text("utf-8"))


@lru_cache(maxsize=None)
def _python_regex(pattern: str) -> re.Pattern:
    """A schema pattern as ECMA-262 (JSON Schema's dialect, what editors use) reads it: there `$`
    ends the input, while Python's `$` also matches before a final newline (`name: "x\\n"`
    would pass and reach the program). The schema keeps the portable `$`; we read it as `\\Z`."""
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", pattern))


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _python_regex(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = validators.extend(Draft202012Validator, {"pattern": _pattern})


@lru_cache(maxsize=1)
def _validator() -> Draft202012Validator:
    return _Validator(schema())


def where(path) -> str:
    """`placement[1].parallel` style name of a path."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "the spec"


def _allowed_keys(subschema: dict) -> list[str]:
    return list(subschema.get("properties", {}))


_RULES = ("dependentSchemas", "then", "else", "allOf")


def _ruled_by(err) -> tuple[dict, str] | None:
    """For an error raised inside a rule (`then`, `dependentSchemas`...): the object
    schema that declares the keys, and the key the rule depends on ('' if none)."""
    node, owner = schema(), None
    parts = list(err.absolute_schema_path)
    for i, part in enumerate(parts[:-1]):
        while isinstance(node, dict) and part not in node and "$ref" in node:
            node = _follow(node, "$ref")  # jsonschema leaves $ref out of the path
        if part in _RULES and isinstance(node, dict) and "properties" in node:
            dep = parts[i + 1] if part == "dependentSchemas" else ""
            owner = (node, dep)
        node = _follow(node, part)
    return owner


def _nodes(err) -> list[dict]:
    """The schema nodes from the root down to the failing keyword's schema, $ref targets included."""
    node, out = schema(), [schema()]
    for part in list(err.absolute_schema_path)[:-1]:
        while isinstance(node, dict) and part not in node and "$ref" in node:
            node = _follow(node, "$ref")  # jsonschema leaves $ref out of the path
            out.append(node)
        node = _follow(node, part)
        out.append(node)
    while isinstance(node, dict) and "$ref" in node:
        node = _follow(node, "$ref")
        out.append(node)
    return [n for n in out if isinstance(n, dict)]


def _described(err, key: str | None = None) -> str | None:
    """Description of the failing value (or of its property `key`), from the nearest schema that has one."""
    for node in reversed(_nodes(err)):
        if key is None and "description" in node:
            return node["description"]
        prop = node.get("properties", {}).get(key) if key is not None else None
        if isinstance(prop, dict):
            return prop.get("description") or (_follow(prop, "$ref").get("description") if "$ref" in prop else None)
    return None


def _follow(node, part):
    if part == "$ref":
        target = schema()
        for p in node["$ref"].lstrip("#/").split("/"):
            target = target[p]
        return target
    return node[part]


def _diagnose(doc: Document, err) -> list[Diagnostic]:
    # Descend into oneOf/anyOf to the branch that fits best.
    if err.context:
        err = best_match(err.context)
    path = tuple(err.absolute_path)
    v, inst, sch = err.validator, err.instance, err.schema
    at = where(path)
    if v in ("additionalProperties", "unevaluatedProperties") and isinstance(inst, dict):
        allowed = _allowed_keys(sch)
        ruled = _ruled_by(err)
        out = []
        for k in inst:
            if k in allowed:
                continue
            declared = ruled[0].get("properties", {}) if ruled else {}
            if k in declared:  # a known key that a rule excludes here
                assert ruled is not None  # declared is empty without a rule
                why = (f"together with {ruled[1]!r}" if ruled[1]
                       else f"with mode {inst['mode']!r}" if isinstance(inst.get("mode"), str) else "here")
                out.append(Diagnostic("S008", f"key {k!r} in {at} cannot be used {why}",
                                      doc.key_loc(path + (k,)), declared[k].get("description")))
                continue
            dym = did_you_mean(k, allowed)
            hint = (dym + " " if dym else "") + f"keys of {at} are: {', '.join(allowed)}"
            out.append(Diagnostic("S001", f"unknown key {k!r} in {at}", doc.key_loc(path + (k,)), hint))
        if out:
            return out
    if v == "required":
        missing = [k for k in err.validator_value if isinstance(inst, dict) and k not in inst] or [err.message]
        if len(missing) > 1:  # one report for all of them: fixing one at a time is trial and error
            keys = ", ".join(repr(k) for k in missing[:-1]) + f" and {missing[-1]!r}"
            return [Diagnostic("S002", f"missing required keys {keys} in {at}", doc.loc(path),
                               "docs/spec.md describes each; `placer init -o spec.yaml` writes a starter spec "
                               "that has them all")]
        key = missing[0]
        desc = _described(err, key)
        return [Diagnostic("S002", f"missing required key {key!r} in {at}", doc.loc(path),
                           f"{key}: {desc}" if desc else None)]
    if v == "uniqueItems" and isinstance(inst, list):
        j = next(j for j, x in enumerate(inst) if x in inst[:j])
        return [Diagnostic("S009", f"{at} lists {json.dumps(inst[j])} twice (items {inst.index(inst[j])} and {j})",
                           doc.loc(path + (j,)), "keep one of them")]
    if v == "pattern" and "propertyNames" in err.absolute_schema_path and isinstance(inst, str):
        return [Diagnostic("S005", f"key {inst!r} in {at} is not well formed", doc.key_loc(path + (inst,)),
                           _described(err) or f"it must match {err.validator_value}")]
    if v in ("enum", "const"):
        choices = err.validator_value if v == "enum" else [err.validator_value]
        dym = did_you_mean(inst, choices) if isinstance(inst, str) else None
        allowed_values = "allowed: " + ", ".join(json.dumps(c) for c in choices)
        said = hints.for_value(path, inst) or (
            hints.quote_boolean(doc.booleans.get(path), path) if any(isinstance(c, str) for c in choices) else None)
        hint = f"{said} ({allowed_values})" if said else (dym + " " if dym else "") + allowed_values
        return [Diagnostic("S004", f"{at} is {json.dumps(inst)}; not an allowed value", doc.loc(path), hint)]
    if v == "type":
        want = err.validator_value if isinstance(err.validator_value, str) else " or ".join(err.validator_value)
        quote = hints.quote_boolean(doc.booleans.get(path), path) if "string" in want else None
        return [Diagnostic("S003", f"{at} must be {'an' if want[0] in 'aeiou' else 'a'} {want}, not "
                           f"{json.dumps(inst) if not isinstance(inst, (dict, list)) else type(inst).__name__}",
                           doc.loc(path), quote or sch.get("description"))]
    if v == "pattern":
        return [Diagnostic("S005", f"{at} is {json.dumps(inst)}, which is not well formed", doc.loc(path),
                           hints.for_value(path, inst) or _described(err) or f"it must match {err.validator_value}")]
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "minLength"):
        return [Diagnostic("S006", f"{at}: {err.message}", doc.loc(path), sch.get("description"))]
    return [Diagnostic("S007", f"{at}: {err.message}", doc.loc(path), sch.get("description"))]


def check_shape(doc: Document) -> list[Diagnostic]:
    """All schema violations, best first."""
    errors = sorted(_validator().iter_errors(doc.data), key=relevance, reverse=True)
    out: list[Diagnostic] = []
    seen = set()
    for e in errors:
        for d in _diagnose(doc, e):
            if (d.code, d.message) not in seen:
                seen.add((d.code, d.message))
                out.append(d)
    return out
