"""Building and tracing a model on meta (generate, plan --deep, run, validate --deep) imports
neither torch._dynamo nor sympy (1.5-2.5 s of start-up together), and leaves torch as it was.
Each check runs in a fresh interpreter: the test process may have imported them already."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_python(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_generating_programs_imports_neither_dynamo_nor_sympy():
    # a module model with attention and layer norm, convolutions with batch norm, torch's
    # TransformerEncoderLayer (dropout, multi-head attention), FSDP2; and validate --deep
    out = run_python("""
        import sys
        from placer.codegen.program import generate
        from placer.model.build import deep_check
        from placer.spec.check import load_spec
        for name in ("tinygpt", "cnn_mixed_modes", "transformer_encoder", "mlp_data_shard_full"):
            spec = load_spec(f"specs/{name}.yaml")
            assert "def train" in generate(spec).text
            assert not [d for d in deep_check(spec) if d.severity == "error"]
        print([m for m in ("torch._dynamo", "torch.fx.experimental.symbolic_shapes", "sympy") if m in sys.modules])
    """)
    assert out == ["[]"]


def test_torch_is_left_as_it_was():
    """After a trace, torch's kernels ask the real modules again."""
    out = run_python("""
        import sys, torch
        from placer.model.deferred import defer_compile_imports
        x = torch.empty(2, 3, device="meta")
        with defer_compile_imports():
            torch.nn.functional.gelu(torch.nn.functional.linear(x, torch.empty(3, 3, device="meta")))
        print(sorted(m for m in sys.modules if m in ("torch._dynamo", "torch.fx.experimental.symbolic_shapes")))
        torch.nn.functional.gelu(x)  # the same wrapped kernel, now outside: torch's own path
        print(sys.modules["torch._dynamo"].__file__.endswith("__init__.py"), torch._dynamo.is_compiling())
        print(sys.modules["torch.fx.experimental.symbolic_shapes"].__file__.endswith("symbolic_shapes.py"))
    """)
    assert out == ["[]", "True", "False", "True"]


def test_anything_else_gets_the_real_modules():
    out = run_python("""
        import sys, torch
        from placer.model.deferred import defer_compile_imports
        with defer_compile_imports():
            import torch._dynamo
            print(torch._dynamo.is_compiling())
            from torch.fx.experimental.symbolic_shapes import ShapeEnv, expect_true, sym_eq
            print(ShapeEnv.__name__, expect_true(True), sym_eq([1, 2], (1, 2)), sym_eq([1], [2]))
        print(sys.modules["torch._dynamo"].__file__.endswith("__init__.py"))
    """)
    assert out == ["False", "ShapeEnv", "True", "True", "False", "True"]
