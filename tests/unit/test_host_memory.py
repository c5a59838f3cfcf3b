"""A worker keeps the memory it frees (runtime/host_memory.py): an optimizer step's
temporaries reuse mapped pages instead of faulting in new ones each step."""
import os
import platform
import subprocess
import sys

import pytest

STEPS = """
import resource, sys, torch
from placer.codegen.runtime.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
torch.set_num_threads(1)
sizes = [(512, 256), (512,), (512, 512), (512,), (512, 512), (512,), (10, 512), (10,)]  # the bench's MLP
params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
opt = torch.optim.Adam(params)
faults = []
for step in range(12):
    for p in params:
        p.grad = torch.randn_like(p)  # new gradients each step, as backward makes them
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    opt.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults[4:])[4])  # the median step once the heap has grown to the step's size
"""

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc and getrusage's fault count")


def faults_per_step(arg: str, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", STEPS, arg], env=clean | env, capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def test_an_optimizer_step_faults_in_no_pages_once_freed_memory_is_kept():
    default = faults_per_step("default")
    if default < 100:
        pytest.skip(f"this glibc already keeps the step's memory ({default} faults a step)")
    assert faults_per_step("keep") < 20 < default


def test_a_malloc_setting_of_the_users_wins():
    # the memory bench sets MALLOC_MMAP_THRESHOLD_ to measure resident memory honestly
    assert faults_per_step("keep", MALLOC_MMAP_THRESHOLD_="131072") >= 100
