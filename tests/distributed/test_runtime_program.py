"""A whole program in the shape the code generator emits (runtime pieces pasted, then one
unrolled step per segment), run with torchrun on 4 CPU ranks: losses and final parameters
equal one device's. The body below is the reference for what codegen writes."""

import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

try:
    from . import _harness as h
except ImportError:
    import _harness as h

pytestmark = pytest.mark.distributed

# spec: devices cpu:0..cpu:3; layers fc1 act1 fc2 act2 head; batch 12, MSELoss
#   segment 0  fc1..act1  data (allreduce, DDP) on cpu:0, cpu:1
#   segment 1  fc2..act2  cpu:2                           (merge 2 -> 1)
#   segment 2  head       data (parameter_server, server cpu:0, outside) on cpu:2, cpu:3
#                         copies: via_host                (split 1 -> 2)
BODY = '''
SEED, STEPS, BATCH = 0, 3, 12
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(max(1, os.cpu_count() // world))
dist.init_process_group("gloo")
device = "cpu"

torch.manual_seed(SEED)  # every rank builds the whole model, then keeps its segments
model = nn.Sequential(OrderedDict(fc1=nn.Linear(6, 16), act1=nn.ReLU(), fc2=nn.Linear(16, 16),
                                  act2=nn.ReLU(), head=nn.Linear(16, 4)))
g0 = dist.new_group([0, 1])  # every rank makes every group, in spec order
g1 = dist.new_group([2])
g2 = dist.new_group([2, 3])
g2_ps = dist.new_group([0, 2, 3])  # segment 2's data ranks plus its server
seg0 = seg1 = seg2 = opt0 = opt1 = opt2 = None
if rank in (0, 1):
    seg0 = ddp_sum(nn.Sequential(model.fc1, model.act1).to(device), g0, bucket_mb=25.0)
    opt0 = torch.optim.SGD(seg0.parameters(), lr=0.05, momentum=0.9)
if rank == 2:
    seg1 = nn.Sequential(model.fc2, model.act2).to(device)
    opt1 = torch.optim.SGD(seg1.parameters(), lr=0.05, momentum=0.9)
if rank in (0, 2, 3):
    seg2 = nn.Sequential(model.head).to(device)
    if rank == 0:  # the server alone owns segment 2's optimizer
        opt2 = torch.optim.SGD(seg2.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.MSELoss()

for step in range(STEPS):
    gen = step_generator(SEED, step)  # the whole batch, identical on every rank
    x, y = make_tensor(gen, (BATCH, 6)), make_tensor(gen, (BATCH, 4))
    for seg in (seg0, seg1, seg2):
        if seg is not None:
            seg.zero_grad(set_to_none=True)
    # forward, segment by segment
    h0 = seg0(local_slice(x, [0, 1], rank)) if rank in (0, 1) else None
    a1 = redistribute(h0, [0, 1], [2], [BATCH, 16])  # merge
    h1 = seg1(a1.requires_grad_()) if rank == 2 else None
    a2 = redistribute(h1, [2], [2, 3], [BATCH, 16], route="via_host")  # split
    h2 = seg2(a2.requires_grad_()) if rank in (2, 3) else None
    # loss: each rank's share of the global mean (b / B), so gradients combine by SUM
    loss = torch.zeros(())
    if rank in (2, 3):
        loss = loss_fn(h2, local_slice(y, [2, 3], rank)) * (h2.shape[0] / BATCH)
        loss.backward()
    # backward, segments in reverse: the input gradient goes back to the previous group
    d1 = redistribute_grad(a2.grad if rank in (2, 3) else None, [2], [2, 3], [BATCH, 16],
                           route="via_host")
    if rank == 2:
        torch.autograd.backward(h1, d1)
    d0 = redistribute_grad(a1.grad if rank == 2 else None, [0, 1], [2], [BATCH, 16])
    if rank in (0, 1):
        torch.autograd.backward(h0, d0)  # DDP's hooks sum segment 0's gradients here
    # gradient sync and optimizer steps, in spec order
    if rank in (0, 1):
        opt0.step()
    if rank == 2:
        opt1.step()
    if rank in (0, 2, 3):
        param_server_step(seg2.parameters(), opt2, g2_ps, server=0, bucket_mb=25.0)
    dist.all_reduce(loss)  # ranks without the loss add 0
    if rank == 0:
        print(f"step {step} loss {loss.item():.6f}", flush=True)
        losses.append(loss.item())

kept = {name: p for name, p in model.named_parameters()
        if any(p is q for seg in (seg0, seg1, seg2) if seg is not None for q in seg.parameters())}
torch.save({"losses": losses, "state": {k: v.detach().clone() for k, v in kept.items()}},
           os.path.join(sys.argv[1], f"rank{rank}.pt"))
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # as the generated program does: gloo's threads may abort Python's shutdown
'''


def program_text() -> str:
    """The program's own imports merged with the pieces', then the pieces, then the body."""
    runtime = h.load_runtime_package()
    imports, pieces = runtime.assemble(["batch", "transfer", "ddp_sum", "param_server"])
    own = ["import os", "import sys", "from collections import OrderedDict", "import torch",
           "import torch.distributed as dist", "import torch.nn as nn"]
    header = ("# Generated-style program (test fixture).\n"
              "# Run: torchrun --nproc-per-node 4 program.py OUTDIR\n")
    merged = own + [line for line in imports if line not in own]
    return header + "\n".join(merged) + "\n\n\n" + pieces + "\n\nlosses = []\n" + BODY


def reference():
    rt = h.pasted_runtime(["batch"])
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(6, 16), act1=nn.ReLU(),
                                      fc2=nn.Linear(16, 16), act2=nn.ReLU(),
                                      head=nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(3):
        gen = rt["step_generator"](0, step)
        x, y = rt["make_tensor"](gen, (12, 6)), rt["make_tensor"](gen, (12, 4))
        opt.zero_grad(set_to_none=True)
        loss = nn.MSELoss()(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


def test_generated_style_program_equals_one_device(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(program_text())
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "4", str(program), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref_losses, ref_params = reference()
    held = set()
    for rank in range(4):
        got = torch.load(out / f"rank{rank}.pt")
        for name, value in got["state"].items():
            held.add(name)
            torch.testing.assert_close(value, ref_params[name].detach(), rtol=h.RTOL,
                                       atol=h.ATOL, msg=lambda m: f"rank {rank} {name}: {m}")
        if rank == 0:
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses),
                                       rtol=h.RTOL, atol=h.ATOL)
    assert held == set(ref_params)
