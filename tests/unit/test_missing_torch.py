"""Without torch installed (simulated by an import blocker), commands that need it say how to install it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "tests" / "cases" / "valid" / "module_model" / "spec.yaml"
INLINE = ROOT / "tests" / "cases" / "invalid" / "bad_enum" / "spec.yaml"

BLOCK = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'torch':
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
for m in [m for m in sys.modules if m.split('.')[0] == 'torch']:
    del sys.modules[m]
from placer.cli.main import main
main(sys.argv[1:], prog_name='placer')
"""


def placer_without_torch(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-c", BLOCK, *args], capture_output=True, text=True, cwd=cwd,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("args, what", [
    (["plan", str(SPEC)], "placer plan"),
    (["generate", str(SPEC), "-o", "/dev/null"], "placer generate"),
    (["run", str(SPEC)], "placer run"),
    (["validate", "--deep", str(SPEC)], "placer validate --deep"),
])
def test_missing_torch_is_one_line(args, what):
    r = placer_without_torch(*args)
    assert r.returncode == 1, r.stderr
    assert r.stderr == f"error: {what} needs PyTorch: pip install 'placer[torch]'\n"
    assert "Traceback" not in r.stdout + r.stderr


def test_plain_validate_needs_no_torch():
    r = placer_without_torch("validate", str(SPEC))
    assert r.returncode == 0 and ": ok (" in r.stdout, r.stderr


def test_an_unforeseen_torch_import_is_caught_too():
    code = BLOCK.replace("from placer.cli.main import main",
                         "from placer.cli.main import main, validate\n"
                         "def boom(*a, **k):\n    import torch\n"
                         "validate.callback = boom")
    r = subprocess.run([sys.executable, "-c", code, "validate", str(INLINE)], capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert (r.returncode, r.stderr) == (1, "error: placer validate needs PyTorch: pip install 'placer[torch]'\n")
