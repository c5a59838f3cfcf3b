"""Building and tracing a model on meta (generate, plan --deep, run, validate --deep) does not
import torch._dynamo (1.5-2 s of start-up: sympy, FSDP, DTensor), and leaves torch as it was.
Each check runs in a fresh interpreter: the test process may have imported it already."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_generating_programs_does_not_import_dynamo():
    # a module model with attention and layer norm, convolutions with batch norm, torch's
    # TransformerEncoderLayer (dropout, multi-head attention), and validate --deep's loss check
    out = run_python("""
        import sys
        from placer.codegen.program import generate
        from placer.model.build import deep_check
        from placer.spec.check import load_spec
        for name in ("tinygpt", "cnn_mixed_modes", "transformer_encoder"):
            spec = load_spec(f"specs/{name}.yaml")
            assert "def train" in generate(spec).text
            assert not [d for d in deep_check(spec) if d.severity == "error"]
        print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
    """)
    assert out.strip() == "no dynamo"


def test_torch_is_left_as_it_was():
    """After a trace, torch's wrapped kernels ask the real torch._dynamo again, and any other use
    of torch._dynamo during a trace gets the real module."""
    out = run_python("""
        import sys, torch
        from placer.model.trace import deferred_dynamo
        x = torch.empty(2, 3, device="meta")
        with deferred_dynamo():
            torch.nn.functional.gelu(x)
            assert isinstance(sys.modules["torch._dynamo"], type(sys)) and not hasattr(sys.modules["torch._dynamo"], "__file__")
        print("torch._dynamo" in sys.modules)
        torch.nn.functional.gelu(x)  # the same wrapped kernel, now outside: torch's own path
        print(sys.modules["torch._dynamo"].__file__.endswith("__init__.py"))
        print(torch._dynamo.is_compiling())
    """)
    assert out.split() == ["False", "True", "False"]


def test_a_trace_that_uses_dynamo_gets_the_real_module():
    out = run_python("""
        import sys
        from placer.model.trace import deferred_dynamo
        with deferred_dynamo():
            import torch._dynamo
            print(torch._dynamo.is_compiling())
        print(sys.modules["torch._dynamo"].__file__.endswith("__init__.py"))
    """)
    assert out.split() == ["False", "True"]
