"""Nested layer names (the spec chooses the depth), `model.output`, factories: how a module
model's layers are found from the spec's selectors, and what a user is told when a name or a
field is wrong. Models come from tests/models/hf_tiny.py (tiny configs, built on meta)."""
from __future__ import annotations

import ast
import shutil
import types
from pathlib import Path

import pytest

from placer.codegen import program
from placer.diagnostics import SpecError
from placer.model import build
from placer.spec import check

MODELS = Path(__file__).resolve().parents[1] / "models"

HEAD = """placer: 1
name: n
model:
  module: {module}
  kwargs: {kwargs}
{output}  input: {{shape: [B, 8], dtype: int64, high: 64}}
  target: {{shape: [B, 8], dtype: int64, high: 64}}
  loss: CrossEntropyLoss
devices: [cpu, cpu:1]
placement:
{placement}
training: {{batch_size: 2, steps: 1, optimizer: {{op: SGD, lr: 0.1}}}}
"""
WRAPPED = "{vocab: 64, d: 16, n_layers: 4, seq: 8}"
GPT2 = "{vocab: 64, d_model: 16, n_layers: 2, seq: 8, n_heads: 2}"


def spec_of(tmp_path, placement: str, cls="Wrapped", kwargs=WRAPPED, output="logits"):
    shutil.copy(MODELS / "hf_tiny.py", tmp_path / "hf_tiny.py")
    shutil.copy(MODELS.parent.parent / "specs" / "models" / "tinygpt.py", tmp_path / "tinygpt.py")
    path = tmp_path / "spec.yaml"
    path.write_text(HEAD.format(module=cls if ":" in cls else f"hf_tiny.py:{cls}", kwargs=kwargs, placement=placement,
                                output=f"  output: {output}\n" if output else ""))
    return check.load_spec(str(path))


def deep_errors(spec):
    return [d for d in build.deep_check(spec) if d.severity == "error"]


def test_a_nested_selector_expands_the_layers_that_hold_it(tmp_path):
    spec = spec_of(tmp_path, "  - {layers: net.embed..net.blocks.1, device: cpu}\n"
                             "  - {layers: [net.blocks.2..net.blocks.3, net.head], device: cpu:1}")
    module = build.build_module(spec)
    assert build.placeable_layers(module) == ["net"]  # no selector goes deeper: today's layers
    graph = build.build_graph(spec, module)
    assert graph.names == ["net.embed", "net.blocks.0", "net.blocks.1", "net.blocks.2", "net.blocks.3", "net.head"]
    assert build.segment_layers(spec, graph) == [graph.names[:3], graph.names[3:]]
    # every parameter is held by exactly one layer
    assert sum(l.params for l in graph.layers) == sum(p.numel() for p in module.parameters())
    assert not deep_errors(spec)


def test_globs_and_top_level_specs_choose_their_depth(tmp_path):
    module = build.build_module(spec_of(tmp_path, "  - {layers: net, device: cpu}"))
    assert build.placeable_layers(module, selectors=["net.blocks.*"]) == [
        "net.embed", "net.blocks.0", "net.blocks.1", "net.blocks.2", "net.blocks.3", "net.head"]
    assert build.placeable_layers(module, selectors=["net.blocks.1.fc"]) == [
        "net.embed", "net.blocks.0", "net.blocks.1.norm", "net.blocks.1.fc", "net.blocks.2", "net.blocks.3",
        "net.head"]
    assert build.placeable_layers(module, selectors=["net", "nothing.here", "*"]) == ["net"]
    # a glob's fixed part opens the layer it names (docs/spec.md): `net.*` places net's children
    assert build.placeable_layers(module, selectors=["net.*"]) == [
        "net.embed", "net.blocks.0", "net.blocks.1", "net.blocks.2", "net.blocks.3", "net.head"]
    assert build.placeable_layers(module, selectors=["net.blocks.1.*"])[2:4] == ["net.blocks.1.norm",
                                                                                "net.blocks.1.fc"]
    # a path inside a leaf opens the layers above it; P001 then says the leaf has no submodules
    assert build.placeable_layers(module, selectors=["net.head.weight"])[-1] == "net.head"


def test_a_wrapped_hugging_face_gpt2_places_by_print_model_names(tmp_path):
    """The issue's case: `self.gpt = GPT2LMHeadModel(cfg)` with gpt.transformer.h.0.. was P001."""
    spec = spec_of(tmp_path, "  - {layers: gpt.transformer.wte..gpt.transformer.h.0, device: cpu}\n"
                             "  - {layers: gpt.transformer.h.1..gpt.lm_head, device: cpu:1}",
                   cls="WrappedGPT2", kwargs=GPT2, output=None)
    assert not deep_errors(spec)
    graph = build.build_graph(spec)
    assert graph.names == ["gpt.transformer.wte", "gpt.transformer.wpe", "gpt.transformer.drop",
                           "gpt.transformer.h.0", "gpt.transformer.h.1", "gpt.transformer.ln_f", "gpt.lm_head"]


def test_a_parent_and_its_child_overlap_and_the_hint_names_the_parent(tmp_path):
    spec = spec_of(tmp_path, "  - {layers: net.blocks.0, device: cpu}\n"
                             "  - {layers: net, device: cpu:1}")
    (d,) = deep_errors(spec)
    assert d.code == "P002" and "'net.blocks.0'" in d.message
    assert d.hint.startswith("'net' is the parent of 'net.blocks.0'")


def test_an_unknown_nested_name_lists_the_layers_under_its_parent(tmp_path):
    spec = spec_of(tmp_path, "  - {layers: net.embed..net.blocks.3, device: cpu}\n"
                             "  - {layers: [net.blocks.7, net.head], device: cpu:1}")
    (d,) = deep_errors(spec)
    assert d.code == "P001" and "net.blocks.7" in d.message
    assert "the layers under 'net.blocks' are net.blocks.0, net.blocks.1, net.blocks.2, net.blocks.3" in d.hint
    spec = spec_of(tmp_path, "  - {layers: net.embed..net.blocks.3, device: cpu}\n"
                             "  - {layers: net.head.weight, device: cpu:1}")
    (d,) = deep_errors(spec)
    assert d.code == "P001" and d.hint == "'net.head' is a layer with no submodules to place: name it whole"


def test_a_missing_output_field_lists_the_fields(tmp_path):
    spec = spec_of(tmp_path, "  - {layers: net, device: cpu}", output="logitz")
    (d,) = deep_errors(spec)
    assert d.code == "M011" and "dict" in d.message and "(its tensor fields: logits)" in d.message
    assert "did you mean 'logits'" in d.hint
    assert d.loc.line == 6  # model.output in the spec
    spec = spec_of(tmp_path, "  - {layers: net, device: cpu}", output=None)
    (d,) = deep_errors(spec)
    assert d.code == "M008" and "logits" in d.message and d.hint.endswith("(output: logits)")
    spec = spec_of(tmp_path, "  - {layers: [embed, blocks.*, ln_f, lm_head], device: cpu}", cls="tinygpt.py:TinyGPT",
                   kwargs="{vocab: 64, d_model: 16, n_layers: 2, seq: 8, n_heads: 2}")
    (d,) = deep_errors(spec)
    assert d.code == "M011" and "returns Tensor" in d.message and d.hint == "forward returns a tensor: remove model.output"


def test_a_factory_returning_a_model_output_takes_its_logits(tmp_path):
    spec = spec_of(tmp_path, "  - {layers: [transformer.wte..transformer.ln_f, lm_head], device: cpu}",
                   cls="make_gpt2", kwargs=GPT2)
    graph = build.build_graph(spec)
    assert graph.output_shape == (2, 8, 64) and graph.names[-1] == "lm_head"
    with pytest.raises(SpecError) as e:
        build.build_graph(spec_of(tmp_path, "  - {layers: [transformer, lm_head], device: cpu}",
                                  cls="make_gpt2", kwargs=GPT2, output="hidden"))
    assert e.value.diagnostics[0].code == "M011" and "CausalLMOutputWithCrossAttentions" in str(e.value)


def test_the_program_returns_the_output_field_by_a_hook(tmp_path):
    spec = spec_of(tmp_path, "  - {layers: net, device: cpu}")
    text = program.generate(spec, out_dir=str(tmp_path)).text
    assert 'OUTPUT = "logits"' in text and "model.register_forward_hook(output_field)" in text
    tree = ast.parse(text)
    (hook,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "output_field"]
    namespace: dict = {"OUTPUT": "logits"}
    exec(compile(ast.Module([hook], []), "<program>", "exec"), namespace)
    assert namespace["output_field"](None, (), {"logits": 1, "loss": 2}) == 1
    assert namespace["output_field"](None, (), types.SimpleNamespace(logits=3)) == 3
    # without model.output the program builds the model as before
    plain = program.generate(spec_of(tmp_path, "  - {layers: [embed, blocks.*, ln_f, lm_head], device: cpu}",
                                     cls="tinygpt.py:TinyGPT", output=None,
                                     kwargs="{vocab: 64, d_model: 16, n_layers: 2, seq: 8, n_heads: 2}"),
                             out_dir=str(tmp_path)).text
    assert "OUTPUT" not in plain and "    return load_user(MODEL)(**MODEL_KWARGS)" in plain


def test_any_callable_returning_a_module_is_a_model(tmp_path):
    (tmp_path / "factories.py").write_text("import functools\nfrom hf_tiny import Wrapped\n"
                                           "make = functools.partial(Wrapped, n_layers=2)\nnot_callable = 3\n")
    spec = spec_of(tmp_path, "  - {layers: net, device: cpu}", cls="factories.py:make", kwargs="{d: 8}")
    assert build.build_graph(spec).total_params == 64 * 8 + 2 * (2 * 8 + 8 * 8 + 8) + 8 * 64 + 64
    with pytest.raises(SpecError) as e:
        build.build_module(spec_of(tmp_path, "  - {layers: net, device: cpu}", cls="factories.py:not_callable"))
    assert e.value.diagnostics[0].code == "M003"
