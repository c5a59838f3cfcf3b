"""Spec -> the source of a standalone torch training program (`placer generate`).

The program imports torch, the standard library and the spec's own model / data files
(never placer). In order: a header (which spec, how to run it, what each rank does),
imports, the spec's values as constants, the hand-written communication pieces it uses
(pasted from `placer/codegen/runtime`), helpers (`templates/helpers.py`), the model,
optimizer and loss, the data, one function per segment (stage), `train(args)` written
out segment by segment (`placer.codegen.train`), then `reference(args)` and `main()`
(`templates/main.py`). Nothing from the spec becomes code except validated identifiers
and `repr()` of values.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import subprocess
import textwrap
import tokenize
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from placer import __version__
from placer.codegen import preflight, runtime, ties
from placer.codegen.loops import rank_orders
from placer.codegen.pipeline import pipeline_train_source
from placer.codegen.segments import FLOAT_DTYPES, Seg, identifier, program_segments, rank_order, torch_schedules_take
from placer.codegen.train import Code, TrainWriter, train_source
from placer.device import Device
from placer.diagnostics import Diagnostic, PlanError, SpecError
from placer.modes import MODES
from placer.plan import crossings
from placer.plan.ir import OpKind
from placer.spec.types import Spec

TEMPLATES = Path(__file__).parent / "templates"
STDLIB = ["argparse", "collections", "contextlib", "ctypes", "errno", "functools", "hashlib", "importlib",
          "importlib.util", "json", "mmap", "os", "queue", "shutil", "signal", "subprocess", "sys", "tempfile",
          "threading", "time"]
CHECKPOINT_ONLY = ("errno", "hashlib", "shutil")  # imported by programs that save checkpoints


@dataclass(frozen=True)
class Program:
    text: str
    devices: tuple[str, ...]
    """Spec devices in rank order: rank r runs devices[r]."""
    nproc_per_node: int
    nnodes: int
    planned_memory: dict[str, int] = field(default_factory=dict)
    """device -> the plan's estimate of its memory for one step (`placer plan`'s total), which
    `placer run` prints beside what each device measured."""
    boundaries: tuple[str, ...] = ()
    """Where several tensors cross between two devices, in words (`run --check`'s hint names them)."""
    reshard: str | None = None
    """Why this program's checkpoints cannot be loaded under another placement (None: they can,
    by the model's names through torch.distributed.checkpoint)."""

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def command(self, path: str = "program.py") -> str:
        if self.nnodes == 1:
            return f"torchrun --nproc-per-node {self.nproc_per_node} {path}"
        return (f"torchrun --nnodes {self.nnodes} --node-rank K --nproc-per-node {self.nproc_per_node} "
                f"--rdzv-endpoint HOST:PORT {path}")


def literal(value) -> str:
    """Python source for a YAML value (repr, with inf / nan spelled so they evaluate)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(literal(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def call_args(args, kwargs) -> str:
    parts = [literal(a) for a in args] + [f"{k}={literal(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def spec_dir(spec: Spec) -> str:
    return os.path.dirname(os.path.abspath(spec.file)) if spec.file not in ("<stdin>", "<spec>", "-") else os.getcwd()


def spec_sha256(spec: Spec) -> str:
    try:
        return hashlib.sha256(Path(spec.file).read_bytes()).hexdigest()
    except OSError:
        return "unknown"


def generate(spec: Spec, filename: str = "program.py", out_dir: str | None = None) -> Program:
    """The program for a valid spec, to be written as `filename` in `out_dir` (default: here):
    it finds the spec's files relative to itself. SpecError / PlanError for what cannot be
    generated."""
    from placer.model.build import checked_graph
    from placer.model.deferred import defer_compile_imports
    from placer.plan.lower import lower
    from placer.plan.place import place

    graph = checked_graph(spec)  # what validate --deep refuses is refused here too
    plan = lower(place(spec, graph), spec, graph)
    with defer_compile_imports():  # torch.optim's constructors are wrapped as meta kernels are
        preflight.check_optimizer(spec)
        preflight.check_lr_schedule(spec)
    devices = rank_order(spec.devices)
    ls = crossings.lockstep(spec, plan.segments)  # a module model: runtime/lockstep.py, GPipe / 1F1B as loops
    pl = spec.pipeline if spec.pipeline and not ls and torch_schedules_take(spec) else None  # else: micro-batch loops
    loops = spec.pipeline.microbatches if spec.pipeline and not pl else 0
    segs = program_segments(plan, spec, graph, loops=bool(loops))
    if ls:  # data segments in lockstep: their layers run inside the whole forward, so no DDP; all-reduced after
        segs = [replace(s, overlap=False) for s in segs]
    tied = ties.program_ties(plan, spec, graph, devices)
    diags = crossings.check(spec, graph, plan.segments)
    if diags:
        raise PlanError(diags)
    per_node = Counter(Device.parse(d).node for d in devices)
    nproc = max(per_node.values())
    from placer.estimate.memory import memory
    from placer.plan.place import layer_geometry

    planned = {d: m.total_bytes for d, m in memory(plan, graph, spec.training.optimizer, spec.training.prefetch,
                                                   lambda name: layer_geometry(spec, name)).items()}
    program = Program("", devices, nproc, len(per_node), planned)
    used = set().union(*(MODES[s.mode].runtime(s, bool(pl)) for s in segs))
    used |= {"replicate"} if not pl and (segs[-1].loss_gather or any(
        TrainWriter.relaid(a, b) for a, b in zip(segs, segs[1:]))) else set()
    used |= {"ties"} if tied else set()
    used |= {"lockstep"} if ls else set()
    cut = not spec.model.inline and len(segs) > 1 and not ls  # torch's pipelining cuts the module model
    used |= {"cut"} if cut else set()  # validate --deep made the same cut (model/build.py _check_cut)
    used |= {"seed"}  # ranks materialise only their segments (TrainWriter.seeded)
    used |= {"clip"} if spec.training.clip_grad_norm is not None else set()
    used |= {"recompute"} if (pl or ls) and any(s.recompute for s in segs) else set()
    used |= {"precision"} if pl and spec.training.precision == "bf16" else set()
    used |= {"accumulate"} if spec.training.accumulate > 1 and TrainWriter(
        segs, len(devices), devices, False, False).syncs_in_backward else set()
    pieces = ["batch", "host_memory"] + (["pipeline"] if pl else ["transfer"] if len(segs) > 1 else []) + [
        name for name in runtime.PIECES if name in used]
    piece_imports, piece_text = runtime.assemble(pieces)
    own_orders = bool(loops) and plan.schedule != "gpipe"  # placer's loops run this schedule's per-rank actions
    ckpt = spec.training.checkpoint is not None
    # what this spec says first (model, data, stages, the step), then the pieces every program shares
    parts = [
        header(spec, program, segs, filename),
        *imports(piece_imports + (["import torch.utils.checkpoint"] if any(s.recompute for s in segs) else []),
                 ckpt, cut, then=[constants(spec, devices, out_dir, layout_id(segs, devices, spec.pipeline),
                                            reshard_blocker(segs, cut, bool(ls), len(per_node))), (TEMPLATES / "launch.py").read_text()]),
        model_source(spec, graph), data_source(spec),
        stages_source(spec, segs, cut, lockstep_source(plan, graph, segs, devices) if ls else None),
        pipeline_train_source(segs, devices, cut, ckpt, pl.schedule, pl.microbatches, tied, spec.training) if pl else
        train_source(segs, devices, cut, ckpt, zero_args(spec), loops, tied, ls, spec.training,
                     (plan.schedule or "gpipe") if own_orders else "gpipe", rank_orders(plan, devices) if own_orders else None,
                     named=bool(spec.model.inputs), own_loss=spec.model.own_loss),
        "# " + "=" * 76 + "\n# Below: placer's runtime, the same in every program that uses it\n"
        "# (placer/codegen/templates and placer/codegen/runtime)",
        (TEMPLATES / "helpers.py").read_text(),
    ]
    if ckpt:
        parts.append((TEMPLATES / "checkpoint.py").read_text())
    if any(s.sync_batchnorm for s in segs):
        parts.append(SYNC_BATCHNORM)
    parts += ["# " + "-" * 76 + " communication pieces\n\n" + piece_text, (TEMPLATES / "main.py").read_text(),
              'if __name__ == "__main__":\n    main()']
    text = formatted("\n\n\n".join(p.strip("\n") + "\n" for p in parts), spec)
    return Program(text, devices, nproc, len(per_node), planned, tuple(crossings.multi_tensor_boundaries(plan)),
                   reshard_blocker(segs, cut, bool(ls), len(per_node)))


def reshard_blocker(segs: list[Seg], cut: bool, lockstep: bool, nodes: int = 1) -> str | None:
    """Why a checkpoint of these segments cannot be resharded, or None: every rank then holds
    whole tensors of the model (one device, DDP replicas, pipeline stages) or DTensor shards of
    them (FSDP2), which torch.distributed.checkpoint saves under the model's names and loads
    into any other such layout. The modes that keep pieces of their own (slices, a server's
    copies, ZeRO-1's partitions) have no name for them it could reshard."""
    if nodes > 1:  # DCP reads every rank's files from one place; each machine writes its own run directory
        return f"its ranks span {nodes} machines, each of which keeps its own ranks' files"
    if cut:
        return "its pipeline stages are cut by torch.distributed.pipelining, whose stage modules are not the model's"
    if lockstep:
        return "its data segments run in lockstep inside the model's forward"
    for s in segs:
        why = MODES[s.mode].reshard_blocker(s)
        if why:
            return f"segment {s.k} ({s.name}) {why}"
        if s.shard == "optimizer":
            return f"segment {s.k} ({s.name}) partitions its optimizer state by ZeroRedundancyOptimizer (shard: optimizer)"
    return None


def layout_id(segs: list[Seg], devices, pipeline) -> str:
    """What placement made of the state each rank holds; a checkpoint of another is resharded."""
    what = [list(devices), [(s.layers, s.ranks, s.mode, s.sync, s.shard, s.server) for s in segs],
            (pipeline.schedule, pipeline.microbatches) if pipeline else None]
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


SYNC_BATCHNORM = '''
def sync_batchnorm(module, group, device):
    """BatchNorm statistics over the whole group's rows: torch's SyncBatchNorm on GPUs, the
    pasted CPU version on host workers."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, group)
    return convert_sync_batchnorm_cpu(module, group)
'''


def optimizer_kwargs(spec: Spec) -> dict:
    """The optimizer's keyword arguments: lr (when given) and the spec's kwargs."""
    opt = spec.training.optimizer
    return ({"lr": opt.lr} if opt.lr is not None else {}) | opt.kwargs


def zero_args(spec: Spec) -> str:
    """`torch.optim.Adam, lr=0.001`: what ZeroRedundancyOptimizer is given to shard."""
    opt, kwargs = spec.training.optimizer, optimizer_kwargs(spec)
    return ", ".join([f"torch.optim.{_dotted(opt.op, 'optimizer', opt.loc)}"] + ([call_args([], kwargs)] if kwargs else []))


def header(spec: Spec, program: Program, segs: list[Seg], filename: str) -> str:
    rel = os.path.relpath(os.path.abspath(spec.file)) if os.path.exists(spec.file) else spec.file
    lines = [
        f"# {spec.name}: a training program generated by placer {__version__}",
        f"#   spec    {rel} (sha256 {spec_sha256(spec)[:16]})",
    ]
    if spec.description:
        lines.append(f"#           {' '.join(str(spec.description).split())[:100]}")
    lines += ["#", f"# Run it:   {program.command(filename)}"]
    if program.nnodes > 1:
        lines.append(f"#           (on each of the {program.nnodes} machines, K = its node index)")
    lines += [
        f"#           python {filename}               starts its own {program.world_size} workers here",
        f"#           python {filename} --reference   the whole model in one process, to compare with",
        "#           add --simulate to run every device as a CPU worker on gloo, --out DIR to keep",
        "#           progress.jsonl, metrics.json and final_params.pt",
        "#",
        "# rank  device         work",
    ]
    for r, device in enumerate(program.devices):
        work = []
        for s in segs:
            if r in s.ranks:
                what = f"{s.name} ({s.layers[0]}{'..' + s.layers[-1] if len(s.layers) > 1 else ''})"
                if MODES[s.mode].data_degree(len(s.ranks), s.replicas) == len(s.ranks) > 1:
                    what += f" 1/{len(s.ranks)} of the batch"
                elif s.mode != "none":
                    what += f" {s.mode} split 1/{len(s.ranks) // s.replicas}"
                    what += f" of 1/{s.replicas} of the batch" if s.replicas > 1 else ""
                work.append(what)
            elif r == s.server:
                work.append(f"parameter server of {s.name}")
        lines.append(f"# {r:<5} {device:<14} {'; '.join(work) or 'idle'}")
    lines.append("#")
    lines.append("# Imports torch and the standard library only (and the spec's own model / data files).")
    return "\n".join(lines) + "\n"


def imports(piece_imports: list[str], checkpoint: bool, cut: bool, then: list[str]) -> list[str]:
    """The standard library's imports, `then` (the constants and the launcher: `python program.py`
    starts torchrun without importing torch), and torch's."""
    std = [f"import {m}" for m in STDLIB if m not in CHECKPOINT_ONLY or checkpoint] + ["from datetime import timedelta"]
    third = ["import torch", "import torch.distributed as dist", "import torch.nn as nn"]
    if checkpoint:  # sharded parameters and optimizer state are saved as their local pieces
        third.append("from torch.distributed.tensor import DTensor")
    if cut:
        third.append("from torch.distributed.pipelining import SplitPoint, pipeline")
    third += [line for line in piece_imports if line not in third and line not in std]
    return ["\n".join(std) + "\n", *then, "\n".join(third) + "\n"]


def _comments_above(text: str) -> str:
    """Comments of lines over 100 columns on lines of their own above the code, wrapped at 100
    columns: the formatter breaks code, not comments."""
    lines = text.splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        row, col = tok.start[0] - 1, tok.start[1]
        if tok.type == tokenize.COMMENT and len(lines[row].rstrip("\n")) > 100:
            code = lines[row][:col].rstrip()
            indent = lines[row][:len(lines[row]) - len(lines[row].lstrip())]
            words = textwrap.wrap(tok.string.lstrip("# "), 100 - len(indent) - 2, break_on_hyphens=False)
            lines[row] = "".join(f"{indent}# {w}\n" for w in words) + (f"{code}\n" if code.strip() else "")
    return "".join(lines)


def formatted(text: str, spec: Spec) -> str:
    """The program as ruff formats it. A generator bug fails here (G005), not in a worker."""
    preflight.parse_program(text, spec)
    text = _comments_above(text)
    from ruff.__main__ import find_ruff_bin

    proc = subprocess.run([find_ruff_bin(), "format", "--isolated", "--line-length", "100", "-"], input=text,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"ruff could not format the generated program: {proc.stderr.strip()}")
    return proc.stdout


def constants(spec: Spec, devices, out_dir: str | None, layout: str = "", reshard: str | None = None) -> str:
    t, rt = spec.training, spec.runtime
    c = Code()
    c("# " + "-" * 76 + " the spec",
      f"SPEC_NAME = {spec.name!r}",
      "# the spec's model and data files, found from this program's own folder",
      f"SPEC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "
      f"{os.path.relpath(spec_dir(spec), out_dir or os.getcwd())!r})",
      f"DEVICES = {list(devices)!r}  # rank r runs DEVICES[r]",
      f"BACKEND = {rt.backend!r}  # auto: NCCL between GPUs, gloo otherwise",
      f"SIMULATE = {rt.simulate!r}  # auto: if this machine lacks a device, every device is a CPU worker",
      f"TIMEOUT_S = {rt.timeout_s!r}  # a collective or copy that waits longer fails the run",
      f"BATCH_SIZE = {t.batch_size!r}  # the global batch",
      f"STEPS = {t.steps!r}",
      f"SEED = {t.seed!r}",
      f"PREFETCH = {t.prefetch!r}  # batches made ahead in a background thread (0: none; 'auto': 2 on a GPU, none on a CPU)",
      f"CLIP_GRAD_NORM = {t.clip_grad_norm!r}  # the global gradient norm is clipped to this (None: not clipped)",
      f"ACCUMULATE = {t.accumulate!r}  # micro-steps per step, each on BATCH_SIZE / ACCUMULATE rows",
      f"PRECISION = {t.precision!r}  # bf16: forward and loss under autocast; parameters and optimizer state float32")
    if t.checkpoint:
        c(f"CHECKPOINT_DIR = {t.checkpoint.dir!r}  # relative to --out",
          f"CHECKPOINT_EVERY = {t.checkpoint.every!r}",
          f"CHECKPOINT_KEEP = {t.checkpoint.keep!r}",
          f"LAYOUT = {layout!r}  # the placement's state on each rank: a checkpoint of another layout is resharded",
          f"RESHARD = {reshard!r}  # why this layout's checkpoints cannot be resharded (None: they can)")
    return c.text()


# -- model --------------------------------------------------------------------------------------------

def _dotted(name: str, what: str, loc) -> str:
    if not all(identifier(p) for p in name.split(".")):
        raise SpecError(Diagnostic("G003", f"{what} {name!r} is not a Python name", loc))
    return name


def model_source(spec: Spec, graph) -> str:
    c = Code()
    c("# " + "-" * 76 + " model, optimizer, loss", "")
    if spec.model.inline:
        _inline_model(spec, c)
    else:
        # the user's names stay in the strings: none can collide with the program's globals
        c(f"MODEL = {spec.model.module!r}  # the spec's model.module, called with MODEL_KWARGS",
          f"MODEL_KWARGS = {literal(spec.model.kwargs)}")
        if spec.model.output is not None:
            c(f"OUTPUT = {spec.model.output!r}  # the spec's model.output: the field of forward's output the loss takes",
              "", "", "def output_field(module, args, output):",
              '    """A forward hook: the model returns its OUTPUT field (a mapping\'s or a ModelOutput\'s)."""',
              "    return output[OUTPUT] if isinstance(output, dict) else getattr(output, OUTPUT)")
        c("", "", "def build_model():",
          '    """The whole model, initialised from the seed (identically on every rank)."""',
          "    torch.manual_seed(SEED)")
        if spec.model.output is None:
            c("    return load_user(MODEL)(**MODEL_KWARGS)")
        else:
            c("    model = load_user(MODEL)(**MODEL_KWARGS)", "    model.register_forward_hook(output_field)",
              "    return model")
    opt = spec.training.optimizer
    _dotted(opt.op, "optimizer", opt.loc)
    kwargs = optimizer_kwargs(spec)
    c("", "", "def make_optimizer(params):", f"    return torch.optim.{opt.op}({call_args(['PARAMS'], kwargs)})"
      .replace("'PARAMS'", "params"))
    c("", "", "def make_scheduler(optimizer):")
    sched = spec.training.lr_schedule
    if sched is None:
        c("    return None  # no training.lr_schedule")
    else:
        _dotted(sched.op, "lr_schedule", sched.loc)
        c('    """training.lr_schedule: stepped once after every step of the optimizer."""',
          f"    return torch.optim.lr_scheduler.{sched.op}({call_args(['OPT'], sched.kwargs)})"
          .replace("'OPT'", "optimizer"))
    if spec.model.own_loss:  # output: loss: the model computed it, from its inputs (HF's labels)
        c("", "", "def compute_loss(output, target):",
          '    """The model\'s own loss (the spec\'s output: loss), a mean over the rows given; no target."""',
          "    return output")
        return c.text()
    _dotted(spec.model.loss, "loss", spec.doc.loc(("model", "loss")))
    c("", "", f"loss_fn = nn.{spec.model.loss}()", "", "")
    out, tgt, why = _loss_reshape(spec, graph)
    c("def compute_loss(output, target):",
      f'    """{spec.model.loss} of {why}, a mean over the rows given."""',
      f"    return loss_fn({out}, {tgt})")
    return c.text()


def _inline_model(spec: Spec, c: Code) -> None:
    runs: list[tuple[str, list]] = []  # (attribute, layers): a repeat's layers share one ModuleList
    assert spec.model.layers is not None  # an inline model
    for layer in spec.model.layers:
        base = layer.name.split(".")[0]
        if "." in layer.name and runs and runs[-1][0] == base:
            runs[-1][1].append(layer)
        else:
            runs.append((base, [layer]))
    c("class Model(nn.Module):",
      '    """The spec\'s layers, run in order; a `repeat` sits in a ModuleList (block.0, block.1, ...)."""', "",
      "    def __init__(self):", "        super().__init__()")
    for base, layers in runs:
        _dotted(base, "layer name", layers[0].loc)
        _dotted(layers[0].op, "op", layers[0].loc)
        make = f"nn.{layers[0].op}({call_args(layers[0].args, layers[0].kwargs)})"
        if "." in layers[0].name:
            c(f"        self.{base} = nn.ModuleList([{make} for _ in range({len(layers)})])")
        else:
            c(f"        self.{base} = {make}")
    c("", "    def forward(self, x):")
    for base, layers in runs:
        if "." in layers[0].name:
            c(f"        for layer in self.{base}:", "            x = layer(x)")
        else:
            c(f"        x = self.{base}(x)")
    c("        return x", "", "",
      "def build_model():",
      '    """The whole model, initialised from the seed (identically on every rank)."""',
      "    torch.manual_seed(SEED)", "    return Model()")


def _loss_reshape(spec: Spec, graph) -> tuple[str, str, str]:
    """How compute_loss feeds the loss (placer.model.build.loss_inputs, decided once here)."""
    shape, tshape = graph.output_shape, spec.model.target.shape
    int_target = spec.model.target.dtype not in FLOAT_DTYPES
    if spec.model.inline or shape is None or len(shape) < 2:
        return "output", "target", "(output, target)"
    if len(tshape) == len(shape) - 1 and int_target:
        return "output.reshape(-1, output.shape[-1])", "target.reshape(-1)", "(output flattened, target flattened)"
    if len(tshape) == len(shape):
        return ("output.reshape(-1, output.shape[-1])", "target.reshape(-1, target.shape[-1])",
                "(output flattened, target flattened)")
    if math.prod(shape[1:]) == math.prod(spec.model.target.concrete(1)[1:]):
        return "output.reshape(-1)", "target.reshape(-1)", "(output flattened, target flattened)"
    return "output", "target", "(output, target)"


# -- data ---------------------------------------------------------------------------------------------

def _tensor_expr(t, rows: str) -> str:
    shape = "(" + ", ".join(rows if d == "B" else str(d) for d in t.shape) + ("," if len(t.shape) == 1 else "") + ")"
    if t.dtype in FLOAT_DTYPES:
        return f"make_tensor(gen, {shape}{'' if t.dtype == 'float32' else f', torch.{t.dtype}'})"
    expr = f"make_tensor(gen, {shape}, torch.{t.dtype}, {t.high - t.low})"
    return f"({expr} + {t.low})" if t.low else expr


def _inputs_expr(m) -> str:
    """The synthetic input: one tensor, or Inputs({name: tensor, ...}) of model.inputs."""
    if not m.inputs:
        return _tensor_expr(m.input, "BATCH_SIZE")
    return "Inputs({" + ", ".join(f"{k!r}: {_tensor_expr(t, 'BATCH_SIZE')}" for k, t in m.inputs) + "})"


def data_source(spec: Spec) -> str:
    m, data = spec.model, spec.training.data
    c = Code()
    c("# " + "-" * 76 + " data", "")
    if data.module is None:
        c("def make_batch(step):",
          '    """Step `step`\'s global batch, the same on every rank: a generator seeded by (SEED, step)."""',
          "    gen = step_generator(SEED, step)",
          f"    return {_inputs_expr(m)}, {_tensor_expr(m.target, 'BATCH_SIZE')}", "", "",
          "def batches(steps, first=0):",
          '    """The global (input, target) batch of steps first.. steps - 1; every rank keeps its own slice."""',
          "    return prefetched(make_batch, steps, first)")
        return c.text()
    c(f"DATA = {data.module!r}  # the spec's training.data.module, called with DATA_KWARGS",
      f"DATA_KWARGS = {literal(data.kwargs)}", "", "",
      "def batches(steps, first=0):",
      '    """The global (input, target) batch of steps first.. steps - 1, from DATA; every rank',
      '    draws the same batches and keeps its own slice."""',
      "    source = iter(load_user(DATA)(**DATA_KWARGS))", "",
      "    def make(step):",
      "        x, y = next(source)",
      "        x = Inputs(x) if isinstance(x, dict) else x  # several named inputs, by keyword",
      "        if x.shape[0] != BATCH_SIZE:",
      '            raise ValueError(f"{DATA} gave a batch of {x.shape[0]} rows at step {step}; '
      'training.batch_size is {BATCH_SIZE}")',
      "        return x, y", "",
      "    for step in range(first):  # resumed at step `first`: the batches before it, drawn and dropped",
      "        batch_of(make, step, steps)",
      "    return prefetched(make, steps, first)")
    return c.text()


# -- stages -------------------------------------------------------------------------------------------

def _member(spec: Spec, names: tuple[str, ...]) -> str:
    """`model.fc1, *model.block[0:2]`: the segment's layers as attributes of the inline Model."""
    items, i = [], 0
    sizes: dict[str, int] = {}
    assert spec.model.layers is not None  # called for inline models only
    for layer in spec.model.layers:
        if "." in layer.name:
            base = layer.name.split(".")[0]
            sizes[base] = sizes.get(base, 0) + 1
    while i < len(names):
        base, _, idx = names[i].partition(".")
        if not idx:
            items.append(f"model.{base}")
            i += 1
            continue
        j = i
        while j + 1 < len(names) and names[j + 1].partition(".")[0] == base:
            j += 1
        lo, hi = int(idx), int(names[j].partition(".")[2])
        if lo == hi:
            items.append(f"model.{base}[{lo}]")
        elif lo == 0 and hi == sizes[base] - 1:
            items.append(f"*model.{base}")
        else:
            items.append(f"*model.{base}[{lo}:{hi + 1}]")
        i = j + 1
    return ", ".join(items)


def _stage_doc(seg: Seg, devices) -> str:
    where = ", ".join(f"{devices[r]} (rank {r})" for r in seg.ranks)
    mode = f", data parallel ({seg.sync}), {seg.rows} rows each" if seg.sync else (
        f", {seg.mode} split" if seg.mode != "none" else "")
    shown = ", ".join(seg.layers) if len(seg.layers) <= 6 else f"{seg.layers[0]} .. {seg.layers[-1]}"
    return f'"""Segment {seg.k} {seg.name!r}: {shown} on {where}{mode}."""'


def lockstep_source(plan, graph, segs: list[Seg], devices) -> tuple[str, dict[int, list[str]]]:
    """(constants, names per segment) of a module model run in lockstep: where each placed layer
    runs and what its output is made of, the replica pipelines, and the plan's crossing copies in
    rank terms."""
    layers = {name: (s.k, graph.layer(name).out_kind,
                     [None if leaf is None else (list(leaf[0]), leaf[1]) for leaf in graph.layer(name).out_leaves])
              for s in segs for name in s.layers}
    # a copy each, or in a GPipe pipeline a send (and its receive) per micro-batch: the first's
    ops = [op for op in plan.unique_ops() if "from" in op.attrs and op.kind != OpKind.RECV and op.microbatch in (None, 0)]
    back = {(op.attrs["of"], op.attrs["leaf"], op.dst[0], op.src[0]) for op in ops if op.phase != "fwd"}
    rows = [(op.attrs["of"], op.attrs["leaf"], devices.index(op.src[0]), devices.index(op.dst[0]), op.route,
             (op.attrs["of"], op.attrs["leaf"], op.src[0], op.dst[0]) in back) for op in ops if op.phase == "fwd"]
    # one pipeline (each segment's first rank) beside split-mode groups, else one per replica
    beside = any(len(s.ranks) > 1 and MODES[s.mode].lockstep_group for s in segs)
    pipes = [[s.ranks[r] for s in segs] for r in range(1 if beside else len(segs[0].ranks))]
    c = Code()
    c("# where each placed layer runs (segment) and what it returns (tensor / tuple / list of",
      "# (shape, dtype) or None): a rank without it rebuilds that from what it receives, or zeros",
      f"LAYERS = {literal(layers)}",
      "# what crosses a boundary, one tensor to one rank each, as the plan counts it:",
      "# (layer, output leaf, from rank, to rank, route, its gradient goes back)",
      f"CROSSINGS = {literal(rows)}",
      f"PIPELINES = {pipes!r}  # in pipeline p, segment k runs on rank PIPELINES[p][k]"
      + ("; each takes its slice of the batch" if len(pipes) > 1 else ""))
    if beside:
        c("# the ranks of each segment over several (a split mode beside the others): each runs the segment's",
          "# layers, what enters is sent to each, what leaves is sent from the first and its gradient to each",
          f"GROUPS = {[list(s.ranks) for s in segs if len(s.ranks) > 1]!r}")
    names = {s.k: list(s.layers) + [r.name for r in graph.root_params if r.trainable and r.consumer in s.layers]
             for s in segs}
    return c.text(), names


def stages_source(spec: Spec, segs: list[Seg], cut: bool, lockstep=None) -> str:
    devices = rank_order(spec.devices)
    c = Code()
    c("# " + "-" * 76 + " stages: one function per segment")
    if lockstep:
        c("", lockstep[0].rstrip("\n"))
    if cut:
        ex = spec.model.input
        shape = "(rows" + "".join(f", {d}" for d in ex.shape[1:]) + ")"
        dtype = "" if ex.dtype == "float32" and ex.high is None else f", torch.{ex.dtype}" + (
            f", {ex.high}" if ex.high is not None else "")
        c("", f"CUT_BEFORE = {[s.layers[0] for s in segs[1:]]!r}  # where segments 1.. begin", "", "",
          "@functools.lru_cache(maxsize=None)",
          "def cut_model(rows):",
          '    """(model, pipe): the model built on the meta device (it holds no memory) and cut into one',
          "    stage per segment by torch.distributed.pipelining, traced at `rows` rows (export fixes",
          "    shapes, so every row count gets its own trace). Stage modules keep the model's parameter",
          '    names: a rank gives its own stages their seed values (materialize_cut)."""',
          '    with torch.device("meta"):',
          "        model = build_model()",
          f"    example = make_tensor(torch.Generator().manual_seed(SEED), {shape}{dtype}).to(\"meta\")",
          "    return model, cut_pipe(model, example, CUT_BEFORE)")
    for seg in segs:
        c("", "")
        if lockstep and not MODES[seg.mode].chain:
            c(f"def {seg.func}(model):", f"    {_stage_doc(seg, devices)}",
              f"    return segment_module(model, {lockstep[1][seg.k]!r})")
        elif not spec.model.inline and MODES[seg.mode].chain:  # validate --deep found it a chain (P087)
            c(f"def {seg.func}(model, pipe):" if cut else f"def {seg.func}(model):",
              f"    {_stage_doc(seg, devices)}",
              f"    return nn.Sequential(*(model.get_submodule(name) for name in {list(seg.layers)!r}))")
        elif not spec.model.inline:
            c(f"def {seg.func}(model, pipe):" if cut else f"def {seg.func}(model):",
              f"    {_stage_doc(seg, devices)}",
              f"    return pipe.get_stage_module({seg.k})" if cut else "    return model")
        else:
            c(f"def {seg.func}(model):", f"    {_stage_doc(seg, devices)}",
              f"    return nn.Sequential({_member(spec, seg.layers)})")
    return c.text()
