"""Cut programs hold what they own (issue 15 item 4): a module model whose segments cannot run in
lockstep is cut by torch.distributed.pipelining from the model built on the meta device, and a
rank gives only its own stages their seed values (runtime/seed.py materialize_cut), bit-exact
with building the model whole. And rank 0 writes final_params.pt as each gathered tensor
arrives (templates/helpers.py write_params), never holding the whole state dict."""
from __future__ import annotations

import importlib
import textwrap
import weakref

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
from torch.distributed.pipelining import SplitPoint, pipeline  # noqa: E402

from placer.api import generate, plan  # noqa: E402
from placer.codegen import program as program_module  # noqa: E402
from placer.codegen.runtime.seed import materialize_cut  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        # made in the forward on the input's device: traced on meta, it must run on the rank's
        return self.head(self.body(x) + torch.ones(1, device=x.device))


def build():
    torch.manual_seed(5)
    return Net()


def test_a_cut_stage_traced_on_meta_takes_its_seed_values_and_runs_on_the_ranks_device():
    whole = build()
    seed = {n: t.detach() for n, t in [*whole.named_parameters(), *whole.named_buffers()]}
    with torch.device("meta"):
        model = build()
    pipe = pipeline(model, mb_args=(torch.empty(4, 4, device="meta"),), split_spec={"head": SplitPoint.BEGINNING})
    first = materialize_cut(pipe.get_stage_module(0), seed, torch.device("cpu"))
    second = pipe.get_stage_module(1)
    for name, t in [*first.named_parameters(), *first.named_buffers()]:
        assert not t.is_meta and torch.equal(t, seed[name]), name
        assert t.data_ptr() != seed[name].data_ptr()  # a copy: not the seed file's mapped pages
    assert all(p.is_meta for p in second.parameters())  # the other stage holds no memory
    materialize_cut(second, seed, torch.device("cpu"))
    x = torch.randn(4, 4)
    assert torch.equal(second(first(x)), whole(x))


def test_a_stage_tensor_the_seed_lacks_is_named():
    model = nn.Linear(2, 2, device="meta")
    model.register_buffer("extra", torch.empty(3, device="meta"))
    seed = {n: torch.zeros(t.shape) for n, t in model.named_parameters()}
    with pytest.raises(RuntimeError, match="'extra' has no value in the seed"):
        materialize_cut(model, seed, torch.device("cpu"))


CUT_SPEC = """\
placer: 1
name: cut_net
model:
  module: net.py:Net
  input: {shape: [B, 4]}
  target: {shape: [B], dtype: int64, high: 2}
  loss: CrossEntropyLoss
devices: [cpu, cpu:1, cpu:2]
placement:
  - {name: front, layers: body, device: cpu}
  - {name: back, layers: head, devices: [cpu:1, cpu:2], parallel: data}
training: {batch_size: 4, steps: 2, optimizer: {op: SGD, lr: 0.1}}
"""


def test_a_cut_program_builds_on_meta_and_fills_only_its_stages(tmp_path):
    """Segments of different sizes are cut by torch's pipelining (not lockstep); the program cuts
    the meta model and each rank materialises its own stage from the seed; the plan counts each
    rank's own stage (what it now holds), not the whole model."""
    (tmp_path / "net.py").write_text(textwrap.dedent('''
        import torch.nn as nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(4, 64), nn.ReLU())
                self.head = nn.Linear(64, 2)

            def forward(self, x):
                return self.head(self.body(x))
    '''))
    (tmp_path / "spec.yaml").write_text(CUT_SPEC)
    out = tmp_path / "program.py"
    generate(str(tmp_path / "spec.yaml"), str(out))
    text = out.read_text()
    assert "def cut_model(rows):" in text
    assert 'with torch.device("meta"):\n        model = build_model()' in text
    assert "seed = seed_tensors(build_model, args.out)" in text and "del seed" in text
    assert "stage = materialize_cut(stage_0_front(model, pipe), seed, device)" in text
    assert "(model, pipe).to(device)" not in text
    assert "note_held(nn.ModuleList(modules))" in text
    devices = {d["device"]: d for d in plan(str(tmp_path / "spec.yaml")).as_dict()["devices"]}
    assert devices["cpu"]["param_bytes"] == (4 * 64 + 64) * 4  # body only
    assert devices["cpu:1"]["param_bytes"] == devices["cpu:2"]["param_bytes"] == (64 * 2 + 2) * 4


def helpers_namespace():
    ns = {m.split(".")[0]: importlib.import_module(m.split(".")[0]) for m in program_module.STDLIB + ["torch"]}
    exec(compile((program_module.TEMPLATES / "helpers.py").read_text(), "helpers.py", "exec"), ns)
    return ns


def test_final_params_are_written_as_they_arrive_and_load_back_as_a_state_dict(tmp_path):
    """write_params lays the file out from shapes and dtypes, then copies each tensor into it as
    the gather hands it over: the file loads with torch.load(weights_only=True) (and mmap) as
    torch.save's dict would, names sorted, and the writer never holds more than one tensor."""
    ns = helpers_namespace()
    values = {"z.weight": torch.randn(256, 1024), "a.bias": torch.arange(5, dtype=torch.int64),
              "m.half": torch.randn(3, 3).to(torch.bfloat16), "empty": torch.empty(0)}
    listing = [[(n, tuple(t.shape), t.dtype) for n, t in list(values.items())[:2]],
               [(n, tuple(t.shape), t.dtype) for n, t in list(values.items())[2:]]]
    path = str(tmp_path / "final_params.pt")
    kept = []

    def gather(put):
        for names in listing:
            for name, _, _ in names:
                value = values[name].clone()
                put(name, value)
                kept.append(weakref.ref(value))
                del value
                assert kept[-1]() is None  # the writer let it go: one gathered tensor at a time

    ns["write_params"](path, listing, gather)
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == sorted(values)
    assert all(torch.equal(loaded[n], values[n]) and loaded[n].dtype == values[n].dtype for n in values)
    mapped = torch.load(path, weights_only=True, mmap=True)
    assert torch.equal(mapped["z.weight"], values["z.weight"])
