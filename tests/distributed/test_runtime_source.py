"""The runtime pieces can be pasted into a generated program (placer/codegen/runtime/__init__.py
rules): torch and stdlib imports only, dependencies declared, names unique, text that runs."""

import ast
import sys

import pytest

try:
    from . import _harness as h
except ImportError:
    import _harness as h

runtime = h.load_runtime_package()


def _top_level_names(text):
    names = set()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_the_expected_pieces_exist():
    assert {"batch", "transfer", "buckets", "ddp_sum", "param_server", "broadcast_sync",
            "syncbn"} <= set(runtime.PIECES)


@pytest.mark.parametrize("name", runtime.PIECES)
def test_piece_imports_only_torch_and_stdlib_at_the_top(name):
    tree = ast.parse(runtime.piece_text(name))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    every = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert top == every, f"{name}: imports must sit at the top level"
    for node in top:
        assert node.end_lineno == node.lineno, f"{name}:{node.lineno}: one import per line"
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 and node.module in runtime.PIECES, f"{name}: {node.module}"
            continue
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        for module in modules:
            root = module.split(".")[0]
            assert root == "torch" or root in sys.stdlib_module_names, f"{name}: imports {module}"


def test_top_level_names_are_unique_across_pieces():
    owner = {}
    for name in runtime.PIECES:
        for top in _top_level_names(runtime.piece_text(name)):
            assert top not in owner, f"{top!r} is defined by both {owner[top]} and {name}"
            owner[top] = name


@pytest.mark.parametrize("name", runtime.PIECES)
def test_piece_uses_no_undeclared_piece(name):
    pasted = set(runtime.resolve([name]))
    others = {top: other for other in runtime.PIECES if other not in pasted
              for top in _top_level_names(runtime.piece_text(other))}
    used = {n.id for n in ast.walk(ast.parse(runtime.piece_text(name))) if isinstance(n, ast.Name)}
    assert not used & set(others), f"{name} uses {sorted(used & set(others))} undeclared"


@pytest.mark.parametrize("name", runtime.PIECES)
def test_piece_pastes_alone_and_runs(name):
    namespace = {}
    exec(compile(runtime.source([name]), f"<{name}>", "exec"), namespace)
    assert _top_level_names(runtime.piece_text(name)) <= set(namespace)


def test_all_pieces_paste_together():
    imports, body = runtime.assemble(runtime.PIECES)
    assert not [line for line in imports if "placer" in line or "from ." in line]
    assert "from ." not in body
    namespace = h.pasted_runtime()
    for public in ("redistribute", "redistribute_grad", "ddp_sum", "all_reduce_grads",
                   "reduce_grads", "broadcast_params", "param_server_step",
                   "broadcast_sync_before_forward", "broadcast_sync_after_backward",
                   "CPUSyncBatchNorm", "convert_sync_batchnorm_cpu", "step_generator",
                   "make_tensor", "local_slice"):
        assert callable(namespace[public]), public


def test_dependencies_come_first():
    order = runtime.resolve(["param_server", "broadcast_sync", "transfer"])
    assert order.index("buckets") < order.index("param_server")
    assert order.count("buckets") == 1
