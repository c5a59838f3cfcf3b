"""The safe positional YAML loader: values, positions, and refusal of hostile input."""
from __future__ import annotations

import io
import time

import pytest

from placer.diagnostics import SpecError
from placer.spec import load
from placer.spec.load import load_file, load_text

REFUSE_WITHIN_S = 1.0  # the bound on refusing hostile input (generous: typically < 0.1 s)


def refused(text, file="spec.yaml"):
    with pytest.raises(SpecError) as e:
        load_text(text, file)
    return e.value.diagnostics[0]


# --- values and positions


def test_values_and_locations_of_values_and_keys():
    doc = load_text("placer: 1\nmodel:\n  layers:\n    - {name: fc, op: Linear}\n", "s.yaml")
    assert doc.data == {"placer": 1, "model": {"layers": [{"name": "fc", "op": "Linear"}]}}
    assert (doc.loc(("placer",)).line, doc.loc(("placer",)).col) == (1, 9)
    assert (doc.loc(("model", "layers", 0, "op")).line, doc.loc(("model", "layers", 0, "op")).col) == (4, 22)
    assert (doc.key_loc(("model", "layers")).line, doc.key_loc(("model", "layers")).col) == (3, 3)
    assert doc.loc(("model", "layers", 0)).file == "s.yaml"


def test_loc_of_a_missing_path_falls_back_to_the_nearest_ancestor():
    doc = load_text("a:\n  b: 1\n")
    assert doc.loc(("a", "zzz", 3)) == doc.loc(("a",))
    assert doc.loc(("nothing",)).line == 1


def test_crlf_and_bom_keep_lines_right():
    doc = load_text(b"\xef\xbb\xbfa: 1\r\nb:\r\n  c: 2\r\n")
    assert doc.data == {"a": 1, "b": {"c": 2}}
    assert doc.loc(("b", "c")).line == 3


def test_exponent_floats_are_numbers_and_quoted_ones_stay_strings():
    doc = load_text('lr: 1e-3\nx: 1.5E+2\ns: "1e-3"\nname: 1e3x\nt: 2026-01-01\n')
    assert doc.data == {"lr": 0.001, "x": 150.0, "s": "1e-3", "name": "1e3x", "t": "2026-01-01"}


def test_a_few_anchors_are_fine():
    doc = load_text("a: &x [1, 2]\nb: *x\n")
    assert doc.data == {"a": [1, 2], "b": [1, 2]}


def test_load_file_reads_stdin(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a: 1\n")))
    doc = load_file("-")
    assert doc.data == {"a": 1} and doc.file == "<stdin>"


def test_missing_file_is_a_diagnostic(tmp_path):
    with pytest.raises(SpecError) as e:
        load_file(str(tmp_path / "nope.yaml"))
    assert e.value.diagnostics[0].code == "L000"
    assert "No such file" in e.value.diagnostics[0].message


# --- errors the loader reports, located


@pytest.mark.parametrize("text, code, line, col", [
    ("a: 1\na: 2\n", "L005", 2, 1),                        # duplicate key
    ("a: [1, 2\n", "L003", 2, 1),                          # unclosed flow sequence
    ("a:\n\tb: 1\n", "L003", 2, 1),                        # tab indentation
    ("a: !custom 1\n", "L004", 1, 4),                      # unknown tag
    ("a: !!python/name:os.system\n", "L004", 1, 4),
    ("base: &b {x: 1}\nc: {<<: *b}\n", "L004", 2, 5),      # merge key
    ("a: 1\n---\nb: 2\n", "L008", 2, 1),                   # second document
    ("? [a, b]\n: 1\n", "L009", 1, 3),                     # complex key
    ("", "L010", 1, 1),
    ("# only a comment\n", "L010", 1, 1),
    ("- a\n- b\n", "L011", 1, 1),
    ("just text\n", "L011", 1, 1),
    ("a: b\x07c\n", "L003", 1, 5),                         # control character
])
def test_loader_errors_are_located(text, code, line, col):
    d = refused(text)
    assert (d.code, d.loc.line, d.loc.col) == (code, line, col), d.format()
    assert d.loc.file == "spec.yaml"


def test_non_utf8_is_located_at_the_bad_byte():
    d = refused(b"a: 1\nb: caf\xe9\n")
    assert (d.code, d.loc.line, d.loc.col) == ("L002", 2, 7)
    assert "0xe9" in d.message


def test_python_tag_is_shown_as_written():
    d = refused("a: !!python/object/apply:os.system ['echo pwned']\n")
    assert d.code == "L004" and "'!!python/object/apply:os.system'" in d.message


# --- hostile input: refused quickly, with a located error


def _timed_refusal(fn):
    t0 = time.perf_counter()
    with pytest.raises(SpecError) as e:
        fn()
    elapsed = time.perf_counter() - t0
    d = e.value.diagnostics[0]
    assert d.loc.line >= 1 and d.loc.col >= 1, d.format()
    assert elapsed < REFUSE_WITHIN_S, f"refusal took {elapsed:.2f} s"
    return d


def billion_laughs(levels: int = 9, width: int = 10) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_under_the_alias_count_is_stopped_by_the_node_budget():
    text = billion_laughs(levels=9, width=10)  # 80 aliases, 10**9 values once expanded
    assert text.count("*") <= load.MAX_ALIASES
    d = _timed_refusal(lambda: load_text(text))
    assert d.code == "L006" and "alias" in d.message


def test_alias_bomb_with_many_aliases_is_stopped_by_the_alias_count():
    d = _timed_refusal(lambda: load_text(billion_laughs(levels=12, width=20)))
    assert d.code == "L006"


def test_recursive_alias_is_refused():
    d = _timed_refusal(lambda: load_text("a: &a [1, *a]\n"))
    assert d.code == "L006" and (d.loc.line, d.loc.col) == (1, 4)  # the collection that holds it


def test_aliases_cannot_nest_deeper_than_the_limit():
    deep = "[" * 60 + "1" + "]" * 60
    d = _timed_refusal(lambda: load_text(f"a: &a {deep}\nb: [[[[[[*a]]]]]]\n"))
    assert d.code == "L007" and d.loc.line == 2


def test_huge_integer_is_a_diagnostic_not_a_crash():
    d = refused("a: " + "1" * 5000 + "\n")
    assert d.code == "L012" and d.loc.line == 1


def test_python_object_apply_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    text = f"name: !!python/object/apply:os.system ['touch {marker}']\n"
    d = _timed_refusal(lambda: load_text(text))
    assert d.code == "L004" and not marker.exists()


def test_fifty_megabyte_file_is_refused_without_reading_it_whole(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.write(b"a: [" + b"1, " * (2 * 1024 * 1024 // 3))  # real YAML well past the limit,
        f.seek(50 * 1024 * 1024)  # then a sparse hole up to 50 MB (fast to write)
        f.write(b"1]\n")
    d = _timed_refusal(lambda: load_file(str(big)))
    assert d.code == "L001" and str(big.stat().st_size) in d.message


def test_endless_stdin_is_refused(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"#" * (load.MAX_BYTES + 10))))
    d = _timed_refusal(lambda: load_file("-"))
    assert d.code == "L001" and d.loc.file == "<stdin>"


@pytest.mark.parametrize("text", [
    "[" * 10_000 + "]" * 10_000,                                      # flow sequences
    "a: " + "{a: " * 10_000 + "1" + "}" * 10_000,                     # flow mappings
    "- " * 10_000 + "x\n",                                            # block sequences on one line
    "".join(" " * i + "a:\n" for i in range(1400)) + " " * 1400 + "1\n",  # block mappings, < 1 MiB
], ids=["flow-seq", "flow-map", "block-seq", "block-map"])
def test_deep_nesting_is_refused(text):
    assert len(text.encode()) < load.MAX_BYTES
    d = _timed_refusal(lambda: load_text(text))
    assert d.code == "L007"
    assert d.loc.line >= 1
