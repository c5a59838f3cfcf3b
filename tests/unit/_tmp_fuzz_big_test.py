"""Property tests: whatever the input, load + check and `placer validate` answer with
diagnostics (located at a line >= 1) or success, never an unexpected exception or a hang."""
from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placer.cli.main import main
from placer.diagnostics import SpecError
from placer.spec import check
from placer.spec.load import load_text

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "specs" / n for n in ("mlp_data_param_server_cpu.yaml", "cnn_spatial.yaml",
                                        "mlp_pipeline_interleaved_1f1b.yaml", "mlp_tensor.yaml", "cnn_channel.yaml")]
TEXTS = [p.read_text("utf-8") for p in SOURCES]
DATA = [yaml.safe_load(t) for t in TEXTS]
YAML_CHARS = ":-[]{},#&*!|>'\"\t\n %@`?.0123456789abB~"

FUZZ = settings(max_examples=1500, deadline=timedelta(seconds=2), derandomize=False,
                suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False)
           | st.text(max_size=12) | st.sampled_from(["B", "cuda:0", "cpu", "data", "fc1", "Linear", "H", "1f1b"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8) | st.sampled_from(["mode", "layers", "op"]), inner,
                                        max_size=4), max_leaves=12)


def assert_handled(text) -> None:
    """load + check either succeed or raise SpecError; every diagnostic is located."""
    try:
        _, diags = check.validate_document(load_text(text, "spec.yaml"))
    except SpecError as e:
        diags = e.diagnostics
        assert diags, "a SpecError without diagnostics"
    for d in diags:
        assert d.loc.file == "spec.yaml" and d.loc.line >= 1 and d.loc.col >= 1, d.format()
        assert d.code[0] in "LSPW" and d.message


@st.composite
def mutated_text(draw) -> str:
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["delete", "replace", "insert", "drop_line", "dup_line", "swap_lines"]))
        lines = text.splitlines(keepends=True)
        if op in ("drop_line", "dup_line", "swap_lines") and len(lines) > 1:
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            if op == "drop_line":
                del lines[i]
            elif op == "dup_line":
                lines.insert(j, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            text = "".join(lines)
            continue
        i = draw(st.integers(0, len(text)))
        if op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 8)):]
        else:
            piece = draw(st.text(alphabet=YAML_CHARS, min_size=1, max_size=4) | st.text(max_size=3))
            text = text[:i] + piece + text[i + (1 if op == "replace" else 0):]
    return text


@st.composite
def replaced_subtree(draw) -> str:
    """A valid spec with one value (anywhere) replaced by random data, or two values swapped."""
    data = copy.deepcopy(draw(st.sampled_from(DATA)))
    paths = []

    def walk(node, path):
        paths.append(path)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            walk(v, path + (k,))

    walk(data, ())
    paths = paths[1:]

    def at(path):
        node = data
        for k in path[:-1]:
            node = node[k]
        return node

    a = draw(st.sampled_from(paths))
    if draw(st.booleans()):
        at(a)[a[-1]] = draw(values)
    else:
        b = draw(st.sampled_from(paths))
        if a[:len(b)] != b and b[:len(a)] != a:  # neither contains the other
            at(a)[a[-1]], at(b)[b[-1]] = at(b)[b[-1]], at(a)[a[-1]]
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


@FUZZ
@given(mutated_text())
def test_mutated_text_is_handled(text):
    assert_handled(text)


@FUZZ
@given(replaced_subtree())
def test_replaced_values_are_handled(text):
    assert_handled(text)


@FUZZ
@given(values)
def test_random_yaml_is_handled(value):
    assert_handled(yaml.safe_dump(value, allow_unicode=True))


@settings(FUZZ, max_examples=100)
@given(st.binary(max_size=300))
def test_random_bytes_are_handled(raw):
    assert_handled(raw)


@settings(FUZZ, max_examples=100)
@given(mutated_text() | replaced_subtree())
def test_cli_exits_0_or_1_without_a_traceback(text):
    result = CliRunner().invoke(main, ["validate", "-"], input=text)
    assert result.exit_code in (0, 1), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 1:
        first = result.stderr.splitlines()[0]
        assert first.startswith("<stdin>:") and int(first.split(":")[1]) >= 1, first
