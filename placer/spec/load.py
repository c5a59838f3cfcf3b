"""Load a spec file: safe YAML with a source position for every node.

Nothing in a spec is ever constructed as an object: YAML is parsed to events,
bounded (size, depth, aliases, tags) before any node tree is built, then
composed and turned into plain JSON-like values. Every value and every key
keeps its `Loc`, addressed by its path (a tuple of keys and indices).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

import yaml

from placer.diagnostics import Diagnostic, Loc, SpecError

MAX_BYTES = 1 << 20  # 1 MiB: a spec for a billion-parameter model is a few KiB
MAX_DEPTH = 64
MAX_ALIASES = 100
MAX_NODES = 100_000  # after alias expansion

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_CORE = "tag:yaml.org,2002:"
_ALLOWED_TAGS = {_CORE + t for t in ("str", "int", "float", "bool", "null", "seq", "map", "timestamp")}
_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")

Path = tuple


@dataclass(frozen=True)
class Document:
    """A loaded spec: plain data plus where each value and key was written."""

    file: str
    data: dict[str, Any]  # load_text refuses a document that is not a mapping
    locs: dict  # path -> Loc of the value
    key_locs: dict  # path -> Loc of the mapping key that names it
    booleans: dict = field(default_factory=dict)  # path -> the text of an unquoted boolean (`no`, `on`)

    def loc(self, path: Path = ()) -> Loc:
        """Best location for `path`: the value, else the nearest ancestor."""
        path = tuple(path)
        while path not in self.locs and path:
            path = path[:-1]
        return self.locs.get(path, Loc(self.file, 1, 1))

    def key_loc(self, path: Path) -> Loc:
        return self.key_locs.get(tuple(path)) or self.loc(path)


def _loc(file: str, mark) -> Loc:
    return Loc(file, mark.line + 1, mark.column + 1)


def _fail(code: str, msg: str, loc: Loc, hint: str | None = None) -> NoReturn:
    raise SpecError(Diagnostic(code, msg, loc, hint))


def _decode(raw: bytes, file: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        before = raw[: e.start]
        line = before.count(b"\n") + 1
        col = e.start - (before.rfind(b"\n") + 1) + 1
        _fail("L002", f"file is not valid UTF-8 (byte 0x{raw[e.start]:02x})", Loc(file, line, col),
              "save the spec as UTF-8")


def _prescan(text: str, file: str) -> None:
    """Bound depth, aliases and tags on the event stream, before composing."""
    depth = aliases = docs = nodes = 0
    for ev in yaml.parse(text, Loader=_Loader):
        if isinstance(ev, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_NODES:
                _fail("L006", f"the spec has more than {MAX_NODES} values", _loc(file, ev.start_mark),
                      "a spec has a few hundred values: is this the right file?")
        if isinstance(ev, yaml.DocumentStartEvent):
            docs += 1
            if docs > 1:
                _fail("L008", "a spec is one YAML document; found a second one", _loc(file, ev.start_mark),
                      "remove the '---' separator and what follows, or split into two files")
        elif isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                _fail("L007", f"nesting deeper than {MAX_DEPTH} levels", _loc(file, ev.start_mark),
                      "a spec needs only a few levels of nesting")
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        elif isinstance(ev, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_ALIASES:
                _fail("L006", f"more than {MAX_ALIASES} YAML aliases", _loc(file, ev.start_mark),
                      "write the values out instead of repeating anchors")
        tag = getattr(ev, "tag", None)
        if tag and tag not in ("!", "?") and tag not in _ALLOWED_TAGS:
            shown = "!!" + tag[len(_CORE):] if tag.startswith(_CORE) else tag
            _fail("L004", f"YAML tag {shown!r} is not allowed", _loc(file, ev.start_mark),
                  "specs are plain data: remove the tag")


def _measure(root, file: str) -> None:
    """Refuse recursive aliases, and alias expansion past MAX_NODES values or MAX_DEPTH levels,
    before anything is expanded. Each node is measured once (aliases share nodes), and an
    alias's target is always measured before the alias (anchors come first), so this costs
    one pass over the written nodes and recurses no deeper than the written nesting."""
    memo: dict = {}  # id(node) -> (values once expanded, levels below)
    active: set = set()

    def measure(node) -> tuple[int, int]:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            _fail("L006", "a YAML alias refers to the collection that contains it", _loc(file, node.start_mark),
                  "specs are trees: write the values out")
        active.add(key)
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        count, height = 1, 0
        for child in children:
            n, h = measure(child)
            count, height = count + n, max(height, h + 1)
            if count > MAX_NODES:
                _fail("L006", f"the spec expands to more than {MAX_NODES} values (alias bomb?)",
                      _loc(file, child.start_mark), "write the values out instead of repeating anchors")
            if height > MAX_DEPTH:
                _fail("L007", f"aliases nest the spec deeper than {MAX_DEPTH} levels", _loc(file, child.start_mark),
                      "write the values out instead of repeating anchors")
        active.discard(key)
        memo[key] = (count, height)
        return memo[key]

    measure(root)


def _to_data(root, file: str):
    """Node tree -> (data, locs, key_locs, booleans), aliases expanded (after `_measure` bounded them)."""
    _measure(root, file)
    locs: dict = {}
    key_locs: dict = {}
    booleans: dict = {}
    scalars = yaml.constructor.SafeConstructor()  # one per load: it caches every node it builds

    def walk(node, path):
        locs[path] = _loc(file, node.start_mark)
        if isinstance(node, yaml.MappingNode):
            out = {}
            for knode, vnode in node.value:
                if not isinstance(knode, yaml.ScalarNode):
                    _fail("L009", "mapping keys must be plain names", _loc(file, knode.start_mark))
                if knode.tag == _CORE + "merge":
                    _fail("L004", "YAML merge keys ('<<') are not allowed", _loc(file, knode.start_mark),
                          "write the keys out")
                key = knode.value
                if key in out:
                    first = key_locs[path + (key,)]
                    _fail("L005", f"duplicate key {key!r} (first written at line {first.line})",
                          _loc(file, knode.start_mark), "keep one of them")
                key_locs[path + (key,)] = _loc(file, knode.start_mark)
                out[key] = walk(vnode, path + (key,))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [walk(v, path + (i,)) for i, v in enumerate(node.value)]
        if node.tag == _CORE + "bool" and not node.style:
            booleans[path] = node.value  # for a "quote it" hint where a string was meant
        if node.tag == _CORE + "timestamp":
            return node.value  # keep dates as written
        if node.tag == _CORE + "str" and not node.style and _EXP_FLOAT.match(node.value):
            return float(node.value)  # YAML 1.2 float (lr: 1e-3) that YAML 1.1 would read as a string
        try:
            return scalars.construct_object(node)
        except ValueError as e:  # e.g. an integer of more than 4300 digits
            _fail("L012", f"value {node.value[:20]!r}{'...' if len(node.value) > 20 else ''} cannot be read: "
                  f"{str(e).split(';')[0]}", _loc(file, node.start_mark), "write a shorter value")

    return walk(root, ()), locs, key_locs, booleans


def _compose(text: str, file: str):
    """YAML text -> node tree (None when empty), bounded first; syntax errors located."""
    try:
        _prescan(text, file)
        return yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        msg = (e.problem or e.context or "invalid YAML").strip()
        _fail("L003", f"YAML syntax: {msg}", _loc(file, mark) if mark else Loc(file, 1, 1),
              "check indentation (spaces, not tabs) and brackets here; quote values that contain ': ' or ' #'")
    except yaml.reader.ReaderError as e:  # control characters: located by character offset
        before = text[: e.position]
        line, col = before.count("\n") + 1, e.position - (before.rfind("\n") + 1) + 1
        code = e.character if isinstance(e.character, int) else ord(e.character)
        _fail("L003", f"YAML: {e.reason} (found U+{code:04X})", Loc(file, line, col),
              f'remove it, or write it as an escape ("\\x{code:02x}") in a double-quoted string')
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        _fail("L003", f"YAML: {str(e).splitlines()[0]}", Loc(file, line, col))


def load_text(raw: bytes | str, file: str = "<spec>") -> Document:
    """Parse spec text (bytes are checked for size and UTF-8 first)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")
    if len(raw) > MAX_BYTES:
        _fail("L001", f"the spec is {len(raw)} bytes; the limit is {MAX_BYTES}", Loc(file, 1, 1),
              "a spec is a few KiB: is this the right file?")
    text = _decode(raw, file)
    root = _compose(text, file)
    if root is None:
        _fail("L010", "the spec is empty", Loc(file, 1, 1), "start from an example in specs/")
    data, locs, key_locs, booleans = _to_data(root, file)
    if not isinstance(data, dict):
        kind = {str: "string", list: "list", bool: "boolean", int: "number", float: "number"}.get(type(data), "value")
        _fail("L011", f"a spec is a mapping of keys; found a {kind}", locs[()],
              "start with 'placer: 1' and 'name: ...'")
    return Document(file, data, locs, key_locs, booleans)


def load_file(path: str, overrides=()) -> Document:
    """Read and parse a spec file ('-' reads standard input), then apply `--set KEY=VALUE` overrides."""
    if path == "-":
        return apply_overrides(load_text(_read_bounded(sys.stdin.buffer, "<stdin>"), "<stdin>"), overrides)
    try:
        with open(path, "rb") as f:
            raw = _read_bounded(f, path)
    except OSError as e:
        _fail("L000", f"cannot read spec: {e.strerror or e}", Loc(path))
    return apply_overrides(load_text(raw, path), overrides)


def split_override(text: str) -> tuple[Path, str]:
    """`training.batch_size=64` -> (('training', 'batch_size'), '64'); list items by index (`placement.0.device`).
    ValueError when it is not KEY=VALUE."""
    key, eq, value = text.partition("=")
    parts = key.strip().split(".")
    if not eq or not all(parts):
        raise ValueError(f"{text!r} is not KEY=VALUE (e.g. training.batch_size=64)")
    return tuple(int(p) if p.isdigit() else p for p in parts), value


def apply_overrides(doc: Document, overrides) -> Document:
    """The document with each `KEY=VALUE` set, in order. VALUE is read as YAML (`64`, `1e-3`, `no`,
    `[cpu, cuda:0]`) and keeps the override as its location, so that the checks that follow name
    it (`--set training.batch_size=abc: error[S003]: ...`) as they name a line of the file."""
    if not overrides:
        return doc
    import copy

    data, locs, key_locs, booleans = copy.deepcopy(doc.data), dict(doc.locs), dict(doc.key_locs), dict(doc.booleans)
    for text in overrides:
        where = f"--set {text}"
        try:
            path, raw = split_override(text)
        except ValueError as e:
            _fail("L013", str(e), Loc(where), "write --set KEY=VALUE, KEY a dotted path such as runtime.max_restarts")
        try:
            node = _compose(raw, where)
        except SpecError as e:  # the override is the location: its text is one line of argv
            raise SpecError([dataclasses.replace(d, loc=Loc(where)) for d in e.diagnostics]) from None
        value, vlocs, _, vbools = _to_data(node, where) if node is not None else (None, {(): Loc(where)}, {}, {})
        parent = data
        for i, part in enumerate(path[:-1]):
            nxt = path[i + 1]
            if isinstance(parent, dict) and part not in parent:
                parent[part] = {}  # --set runtime.max_restarts=2 on a spec without runtime:
            parent = _child(parent, part, path[:i + 1], where)
            if not isinstance(parent, (dict, list)) or (isinstance(parent, list) and not isinstance(nxt, int)):
                _fail("L013", f"{'.'.join(map(str, path[:i + 1]))} is {_kind(parent)}: it has no entry {nxt!r}",
                      Loc(where), "name a key of a mapping, or an index of a list (placement.0.device)")
        if isinstance(parent, list):
            _child(parent, path[-1], path, where)  # the index must exist
        parent[path[-1]] = value
        for table in (locs, key_locs, booleans):  # what was written under the path is gone
            for p in [p for p in table if p[:len(path)] == path]:
                del table[p]
        locs.update({path + p: Loc(where) for p in vlocs})
        booleans.update({path + p: b for p, b in vbools.items()})
        key_locs[path] = Loc(where)
    return Document(doc.file, data, locs, key_locs, booleans)


def _child(parent, part, path: Path, where: str):
    if isinstance(parent, list):
        if not isinstance(part, int) or part >= len(parent):
            _fail("L013", f"{'.'.join(map(str, path[:-1]))} has {len(parent)} items; there is no item {part}",
                  Loc(where), f"list items are numbered from 0 to {len(parent) - 1}")
        return parent[part]
    return parent[part] if isinstance(parent, dict) else parent


def _kind(value) -> str:
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}.get(
        type(value), "a list" if isinstance(value, list) else "a value")


def _read_bounded(f, file: str) -> bytes:
    """Read at most MAX_BYTES: never read a huge file (or an endless stream) whole."""
    raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        try:
            size = os.fstat(f.fileno()).st_size  # 0 for pipes and devices
        except (OSError, ValueError, AttributeError):
            size = 0
        _fail("L001", f"the spec is {size} bytes; the limit is {MAX_BYTES}" if size > MAX_BYTES
              else f"the spec is larger than the limit of {MAX_BYTES} bytes", Loc(file, 1, 1),
              "a spec is a few KiB: is this the right file?")
    return raw
