"""The generated program's `train(args)`: setup, then one training step written out
segment by segment, so every copy, split, merge and gradient sync is a visible call.

Every rank runs the same code and walks the same transitions in the same order (a rank
in neither group of a transition returns at once), so the point-to-point messages of
`redistribute` never deadlock. Each segment is its own autograd graph: its input is a
fresh leaf, and in backward the gradient of that leaf goes back to the previous group.
Losses are scaled by rows / BATCH_SIZE on every rank, so every gradient combination is
a SUM and the step equals the one-device step on the whole batch.

Groups hold activations in one of three layouts (`Seg.layout`): slices of a dim (rows of
a data group, bands of a spatial one), the whole tensor on every rank (channel, tensor),
or one rank. `relayout` moves between any two. A gpipe pipeline that torch's schedules
cannot run is this same step inside micro-batch loops (`gpipe_step`); under another schedule
each rank runs its actions in the schedule's order (codegen/loops.py), with the same copies.
"""
from __future__ import annotations

from placer.codegen import loops, ties
from placer.codegen.segments import Seg
from placer.codegen.train_options import TrainingOptions
from placer.modes import MODES, data, tensor


class Code:
    """Lines of Python with an indentation level."""

    def __init__(self, indent: int = 0):
        self.lines: list[str] = []
        self.level = indent

    def __call__(self, *lines: str) -> "Code":
        for line in lines:
            self.lines.append("    " * self.level + line if line else "")
        return self

    def indent(self) -> "Code":
        self.level += 1
        return self

    def dedent(self) -> "Code":
        self.level -= 1
        return self

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def ranks_text(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class TrainWriter(TrainingOptions):
    steps_all = False
    """Whether the step calls every optimizer of the rank in one loop (torch's pipeline schedules)."""

    def __init__(self, segs: list[Seg], world: int, devices, cut: bool, checkpoint: bool, zero_args: str = "",
                 microbatches: int = 0, tied=(), lockstep: bool = False, training=None, schedule: str = "gpipe",
                 orders: dict[int, str] | None = None, named: bool = False, own_loss: bool = False):
        self.segs, self.world, self.devices = segs, world, devices
        self.named = named
        """model.inputs: the batch's input is Inputs (runtime/batch.py), passed to forward by keyword."""
        self.own_loss = own_loss
        """output: loss: the model's output is its loss, one number: the rows are the target's."""
        self.lockstep = lockstep
        """A module model run in lockstep (runtime/lockstep.py): every rank runs the whole forward."""
        self.scheduled = training is not None and training.lr_schedule is not None
        """training.lr_schedule: every optimizer gets a scheduler, stepped after it."""
        self.clip = training.clip_grad_norm if training is not None else None
        """training.clip_grad_norm: the global norm is clipped between the gradient syncs and the steps."""
        self.accumulate = training.accumulate if training is not None else 1
        """training.accumulate: micro-steps per step (with a pipeline, each a whole pipeline step)."""
        self.bf16 = training is not None and training.precision == "bf16"
        """precision bf16: every segment's forward and the loss under autocast."""
        self.tied = list(tied)
        """The parameters tied across segments (codegen/ties.py ProgramTie)."""
        self.microbatches = microbatches
        """> 0: a pipeline that torch's schedules cannot run, written as micro-batch loops."""
        self.schedule, self.orders = schedule, orders
        """Its schedule; other than gpipe, each rank's actions in order (codegen/loops.py)."""
        self.cut, self.checkpoint = cut, checkpoint
        self.zero_args = zero_args
        """`torch.optim.X, lr=...`: the optimizer class and arguments ZeroRedundancyOptimizer wraps."""
        self.c = Code(1)
        self.binding_at, self.uses_host, self.uses_device_ids = 0, False, False
        # whose parameters are split (channel, tensor, FSDP): gathered whole by `owned()` to be saved
        self.gathered = [s for s in segs if s.sharded_params and s.has_params and len(s.ranks) > 1]
        self.own = "owned()" if self.gathered else "own"

    @property
    def seeded(self) -> bool:
        """Whether ranks build the model on the meta device and materialise only their segments
        from the seed file (runtime/seed.py), in lockstep the parent's glue too; where torch's
        pipelining cuts the model, it cuts the meta model and a rank fills its own stages."""
        return True

    @property
    def beside(self) -> bool:
        """Whether, in lockstep, split-mode groups run beside one-device segments (one pipeline,
        `GROUPS`), not replica pipelines."""
        return self.lockstep and any(len(s.ranks) > 1 and MODES[s.mode].lockstep_group for s in self.segs)

    def placed(self, stage: str) -> str:
        """The stage module `stage` on this rank's device, with its seed values."""
        return f"materialize({stage}, model, seed, device)" if self.seeded else f"{stage}.to(device)"

    # -- small helpers ----------------------------------------------------------------------------
    def cond(self, ranks) -> str | None:
        """The condition `rank` is one of `ranks` (None: every rank is)."""
        ranks = tuple(ranks)
        if set(ranks) == set(range(self.world)):
            return None
        return f"rank == {ranks[0]}" if len(ranks) == 1 else f"rank in {tuple(sorted(ranks))}"

    def when(self, ranks, *body: str) -> None:
        cond = self.cond(ranks)
        if cond is None:
            self.c(*body)
        else:
            self.c(f"if {cond}:").indent()(*body).dedent()

    def guarded(self, expr: str, ranks) -> str:
        cond = self.cond(ranks)
        return expr if cond is None else f"{expr} if {cond} else None"

    def tuple_of(self, prefix: str) -> str:
        names = [f"{prefix}{s.k}" for s in self.segs]
        return f"({names[0]},)" if len(names) == 1 else f"({', '.join(names)})"

    def route(self, seg: Seg) -> str:
        self.uses_host |= seg.route != "via_host"
        return '"via_host"' if seg.route == "via_host" else '"via_host" if host else "direct"'

    def describe(self, seg: Seg) -> str:
        where = ", ".join(f"{self.devices[r]}" for r in seg.ranks)
        layers = seg.layers[0] if len(seg.layers) == 1 else f"{seg.layers[0]}..{seg.layers[-1]}"
        text = f"segment {seg.k} {seg.name!r} ({layers}) on {where}"
        how = MODES[seg.mode].describe(seg, self.devices)
        return f"{text}: {how}" if how else text

    # -- the function -----------------------------------------------------------------------------
    def rows(self, out: str, y: str) -> str:
        """The rows a loss is the mean of: the output's, or the target's for the model's own loss."""
        return f"{y}.shape[0]" if self.own_loss else f"{out}.shape[0]"

    def call_model(self, x: str) -> str:
        """The model's call on the batch's input `x`: by keyword for several named inputs."""
        return f"model(**{x})" if self.named else f"model({x})"

    def write(self) -> str:
        c = self.c
        head = Code()("def train(args):")
        head.indent()('"""One worker (rank) of the placed training run; torchrun starts one per device."""')
        self.setup()
        c("")
        c(f"first, losses = resume_checkpoint(args, rank, modules, optimizers{self.sched_arg}, model=model)"
          "  # step 0 unless resuming"
          if self.checkpoint else "first, losses = 0, []  # no checkpoints: a restart starts at step 0")
        c("data = batches(args.steps, first)", "start = time.perf_counter()",
          "batch_losses = BatchLosses(losses, args, rank, start)  # summed off the critical path")
        c("for step in range(first, args.steps):").indent()
        self.step()
        c.dedent()
        c("batch_losses.settle()  # the last window's losses")
        self.finish()
        binding = []
        if self.uses_host:
            binding += ["# gloo moves host tensors only: a GPU rank on gloo stages its copies through host memory",
                        'host = backend == "gloo" and device.type == "cuda"']
        if self.uses_device_ids:
            binding.append('device_ids = [device.index] if device.type == "cuda" else None')
        c.lines[self.binding_at:self.binding_at] = ["    " + line for line in binding]
        return head.text() + c.text()

    def setup(self) -> None:
        c = self.c
        c('rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])',
          "if world != len(DEVICES):",
          '    raise SystemExit(f"this program runs one worker per device: start {len(DEVICES)}, not {world}")',
          "simulate, why = simulation(args)",
          "device = bind_device(DEVICES[rank], simulate)",
          "backend = pick_backend(simulate)",
          'if device.type == "cpu":  # share the cores among this machine\'s workers',
          '    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))',
          "keep_freed_memory()  # each step's new tensors reuse freed pages instead of faulting in new ones",
          "dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT_S))",
          "if args.measure:  # placer run asks for the bytes each rank sends and its tensors' peak",
          "    count_sent_bytes()",
          '    if device.type == "cpu":',
          "        TENSOR_PEAK.count()",
          "if rank == 0 and why:",
          '    print(f"simulating {world} devices as CPU workers on gloo: {why}", flush=True)',
          "if rank == 0 and args.out and not resuming(args):  # a resumed or restarted run appends",
          '    open(os.path.join(args.out, "progress.jsonl"), "w").close()',
          )
        self.binding_at = len(c.lines)  # `host` and `device_ids` go here if the step uses them
        if self.lockstep:
            self.uses_host = True
            c("", "# every rank runs the whole model's forward (the parent's glue); each placed layer runs",
              "# only on its segment's rank (Lockstep, below). The first worker of each machine builds the",
              "# model from the seed once and saves it; every rank builds it on the meta device (no memory)",
              "# and takes the values of its own segments and of the glue",
              "with uncounted():  # set-up, not training: left out of the bytes sent",
              "    seed = seed_tensors(build_model, args.out)",
              'with torch.device("meta"):',
              "    model = build_model()")
            copies = [list(names) for t in self.tied for names in t.aliases[1:]]
            if copies:
                c("untie(model, " + repr(copies) + ")  # each segment using a tied parameter holds a copy")
        elif self.cut:
            c("", "# the first worker of each machine builds the whole model from the seed once and saves it;",
              "# every rank cuts the model built on the meta device (cut_model) and fills its own stages",
              "with uncounted():  # set-up, not training: left out of the bytes sent",
              "    seed = seed_tensors(build_model, args.out)")
        else:
            c("", "# the first worker of each machine builds the whole model from the seed once and saves it;",
              "# every rank builds it on the meta device (no memory) and takes its own segments' values",
              "with uncounted():  # set-up, not training: left out of the bytes sent",
              "    seed = seed_tensors(build_model, args.out)",
              'with torch.device("meta"):',
              "    model = build_model()")
        c("own = {}  # name -> parameter, for those this rank owns (saved at the end)",
          "if asked_anywhere(args.grads) and not resuming(args):  # run --check compares first-step gradients",
          "    record_first_grads(own)")
        if self.clip is not None:
            c("norm_params = []  # the parameters whose gradients this rank counts in the global norm")
        for seg in self.segs:
            self.setup_segment(seg)
        if self.lockstep:
            c("", "# the parent's glue (modules no segment places, the parent's own tensors) runs on every rank;",
              "# the layers of segments this rank lacks stay on the meta device: stand-ins run in their place",
              f"materialize_rest(model, seed, device, LAYERS, {self.tuple_of('seg')})",
              "note_held(model)  # what this rank holds, for metrics.json (the plan's weights and buffers)")
        if self.seeded:
            c("del seed  # the rest of the model stays on the meta device: this rank holds only what it owns")
        c(*ties.emit_setup(self.tied))
        if self.lockstep:
            c("", "# a placed layer elsewhere: its output arrives from its rank where a layer here reads it, else zeros",
              "crossing = Lockstep(model, rank, LAYERS, CROSSINGS, PIPELINES, device, host, batch=BATCH_SIZE"
              + (", groups=GROUPS)" if self.beside else ")"))
            for seg in self.segs:
                if seg.recompute:
                    self.when(seg.ranks, f"# recompute: segment {seg.k}'s layers keep only their inputs; backward runs "
                              "each forward again", f"recompute_layers(model, {list(seg.layers)!r})")
        if self.clip is not None:
            c(*ties.emit_norm_once(self.tied))
        c("", "# every segment this rank computes or keeps, and its optimizers",
          f"modules = [m for m in {self.tuple_of('seg')} if m is not None]")
        if self.cut:
            c("note_held(nn.ModuleList(modules))  # what this rank holds, for metrics.json: its own stages")
        if self.checkpoint or self.steps_all or self.scheduled or self.clip is not None:
            c(f"optimizers = [o for o in {self.tuple_of('opt')} if o is not None]")
        if self.scheduled:
            c("schedulers = [make_scheduler(o) for o in optimizers]  # training.lr_schedule, one per optimizer")
        if self.gathered:
            self.owned()
        if self.orders:
            loops.emit_order(self)

    def owned(self) -> None:
        c = self.c
        c("", "def owned():").indent()
        c('"""name -> parameter, for those this rank owns. Split ones are gathered whole: DTensors by',
          'finish as it writes each (GATHERED), channel slices here; every rank of their group takes part."""',
          "params = dict(own)")
        c("with uncounted():  # saving, not training: the gathers are left out of the bytes sent").indent()
        for seg in self.gathered:
            body = MODES[seg.mode].emit_gather(seg)
            self.when(seg.ranks, *body, f"if rank == {seg.owner}:", "    params.update(whole)")
        c.dedent()
        c("return params").dedent()

    def setup_segment(self, seg: Seg) -> None:
        c, k = self.c, seg.k
        c("", f"# {self.describe(seg)}")
        group = None
        if seg.mode != "none":  # every rank creates every group, in the same order
            group = f"g{k}"
            ranks = sorted(seg.holders) if seg.sync == "parameter_server" else list(seg.ranks)
            note = "  # the data ranks and their server" if seg.sync == "parameter_server" else ""
            if seg.replicas > 1:
                c(*tensor.emit_groups(k, list(seg.ranks), seg.replicas))
                if seg.sync == "parameter_server" and not seg.slice_server:  # spatial: data's, over every rank
                    c("# every replica's ranks and the parameter server",
                      f"ps{k} = dist.new_group({ranks}, timeout=timedelta(seconds=TIMEOUT_S))")
            else:
                c(f"{group} = dist.new_group({ranks}, timeout=timedelta(seconds=TIMEOUT_S)){note}")
            if seg.sync_batchnorm and seg.sync == "parameter_server" and seg.server not in seg.ranks:
                c(f"{group}_bn = dist.new_group({list(seg.ranks)}, timeout=timedelta(seconds=TIMEOUT_S))  # batch statistics: the data ranks only")
        c(f"seg{k} = opt{k} = None" if seg.has_params or self.checkpoint or self.steps_all else f"seg{k} = None")
        cond = self.cond(seg.holders)
        if cond:
            c(f"if {cond}:").indent()
        if self.cut:
            c(f"model, pipe = cut_model({seg.rows})", f"stage = materialize_cut({seg.func}(model, pipe), seed, device)")
        else:
            c(f"stage = {self.placed(f'{seg.func}(model)')}")
        if seg.has_params and seg not in self.gathered:  # (split parameters are saved through owned())
            if seg.owner in seg.holders and len(seg.holders) > 1:
                c(f"if rank == {seg.owner}:").indent()("own.update(named_params(stage, model))").dedent()
            else:
                c("own.update(named_params(stage, model))")
        if seg.sync_batchnorm:
            bn = f"{group}_bn" if seg.sync == "parameter_server" and seg.server not in seg.ranks else group
            if self.lockstep:  # in the model, whose forward calls them; the stage then holds those
                c(f"stage = {seg.func}(convert_layers(model, {list(seg.layers)!r}, "
                  f"lambda m: sync_batchnorm(m, {bn}, device)))")
            else:
                c(f"stage = sync_batchnorm(stage, {bn}, device)")
        if self.lockstep and seg.shard == "full" and not seg.chained and seg.replicas == 1:  # a unit per placed
            # layer: what the model's forward calls (a chain group's split is sharded itself: the model's forward
            # calls it; FSDP2 x TP's over its mesh's dp dim, tensor.emit_fsdp_stage)
            c(f"seg{k} = fully_shard_layers(stage, {list(seg.layers)!r}, g{k}, device.type)  # gradients "
              "reduce-scattered in backward")
        else:
            c(*MODES[seg.mode].emit_stage(seg, self.checkpoint))
        if seg in self.gathered:  # DTensors (tensor, FSDP2) or channel slices: their gradients gathered whole
            c(*MODES[seg.mode].emit_whole_grads(seg))
        if seg.rows_in:
            c(f"replica_rows_around(model, {list(seg.rows_in)!r}, {list(seg.layers)!r}, dp{k}, "
              f"next(p for p in {tensor.positions(seg.ranks, seg.replicas)} if rank in p))  # each replica's rows in, "
              "gathered whole after")
        if seg.chained:
            chain = (f"run_as_chain(model, {list(seg.layers)!r}, {MODES[seg.mode].chain_call(seg)})  # the model's "
                     "forward calls the split chain")
            # (a parameter server outside the group holds the whole layers and runs no forward of them)
            if seg.holders != seg.ranks:
                self.when(seg.ranks, chain)
            else:
                c(chain)
        self.uses_device_ids |= data.uses_ddp(seg)
        if seg.has_params and seg.shard == "optimizer" and seg.replicas > 1:
            c(*tensor.emit_zero_slices(k, seg.replicas, self.zero_args))
        elif seg.has_params and seg.shard == "optimizer":
            c(*data.emit_optimizer(k, len(seg.ranks), self.zero_args))
        elif seg.has_params and seg.slice_server:
            pass  # the server's optimizer steps copies of the slices (tensor.emit_server, below)
        elif seg.has_params:
            if len(seg.steppers) < len(seg.holders):
                c(f"if rank == {seg.owner}:  # it alone keeps the optimizer" if len(seg.steppers) == 1 else
                  f"if rank in {seg.steppers}:  # the first data replica alone keeps the optimizer")
                c(f"    opt{k} = make_optimizer(seg{k}.parameters())")
            else:
                c(f"opt{k} = make_optimizer(seg{k}.parameters())")
        self.norm_share(seg)
        if cond:
            c.dedent()
        if seg.has_params and seg.slice_server:
            c(*tensor.emit_server(seg, self.cond))

    def step(self) -> None:
        c, segs = self.c, self.segs
        c('STATUS.at(step, "data")  # what this rank is doing, for placer run\'s report if a rank hangs',
          'with timer("data"):', "    x, y = next(data)  # the whole batch of this step, on every rank",
          "for m in modules:", "    m.zero_grad(set_to_none=True)")
        for seg in segs:
            if seg.sync == "broadcast" and seg.has_params and seg.replicas > 1:
                self.when(seg.ranks, "# every replica starts from the first replica's weights", 'with timer("comm"):',
                          *tensor.emit_broadcast(seg))
            elif seg.sync == "broadcast" and seg.has_params:
                self.when(seg.ranks, '# every replica starts from the root\'s weights', 'with timer("comm"):',
                          f"    broadcast_sync_before_forward(seg{seg.k}.parameters(), g{seg.k}, "
                          f"root={seg.ranks[0]}, bucket_mb={seg.bucket_mb!r})")
        if self.lockstep and len(segs[0].ranks) > 1 and not self.beside:
            c("# this rank's replica pipeline (its rank in every segment) takes its slice of the batch",
              "x, y = local_slice(x, PIPELINES, crossing.segments), local_slice(y, PIPELINES, crossing.segments)")
        if self.accumulate > 1:
            self.accumulate_step()
        else:
            self.micro_step()
        c(*ties.emit_sync(self.tied))
        c("", 'STATUS.at(step, "gradient sync and optimizer step")')
        at = len(c.lines)
        c("# gradient sync and optimizer steps, segment by segment" if self.clip is None else
          "# gradient sync, segment by segment")
        for seg in segs:
            self.sync(seg)
        if len(c.lines) == at + 1:  # nothing to sync here (DDP and FSDP synced during backward)
            del c.lines[at:]
        self.clip_and_step()
        c("", "# the loss of the whole batch: ranks without it add 0",
          "total = (loss.detach() if loss is not None else torch.zeros(())).float().cpu()")
        self.add_loss()

    def micro_step(self) -> None:
        """Every forward and backward of one micro-step (the whole step without accumulate): a
        pipeline's schedule over its micro-batches, or the segments' forward and backward."""
        segs = self.segs
        if self.lockstep and self.orders and len({s.ranks for s in segs}) < len(segs):  # several stages a rank
            loops.lockstep_stages_step(self)
        elif self.lockstep and self.orders:
            loops.lockstep_step(self)
        elif self.lockstep:
            self.lockstep_step()
        elif self.orders:
            loops.stage_step(self)
        elif self.microbatches:
            self.gpipe_step()
        else:
            self.forward_backward()

    def lockstep_step(self) -> None:
        """The whole forward on every rank, the loss on the last segment's, backward segment by
        segment in reverse (runtime/lockstep.py)."""
        c, last, m = self.c, self.segs[-1], self.microbatches
        if m:
            c("", f"# GPipe in lockstep: every micro-batch forward, then every one backward; {m} micro-batches",
              f"xs, ys, saved = x.chunk({m}), y.chunk({m}), []", f"for mb in range({m}):")
            c.indent()("x, y = xs[mb], ys[mb]")
        c("", "# forward: the whole model on every rank; what crosses a boundary is sent as it is made",
          *self.autocast(f"out = {self.call_model('x.to(device)')}"),
          "", "# loss: the last segment's rank, a share rows / BATCH_SIZE of the global mean", "loss = None")
        self.when(last.ranks, *self.autocast(f"loss = compute_loss(out, y.to(device)) * ({self.rows('out', 'y')} / BATCH_SIZE)"))
        c("out = None  # the loss's graph keeps what its backward needs (elsewhere: a stand-in's zeros)")
        if m:
            c("saved.append((loss, crossing.take()))").dedent()
            c("mb_losses = []", "for loss, crossed in saved:").indent()
            c('with timer("comm"):', "    crossing.backward(loss, crossed)", "mb_losses.append(loss)").dedent()
            c("loss = None if mb_losses[0] is None else sum(mb_losses).detach()  # this rank's share of the batch's "
              "loss", "# the graphs were kept for glue that segments share (retain_graph): let them go before the next "
              "forward", "saved = crossed = mb_losses = None")
        else:
            c("", "# backward, segments in reverse: the gradient of every tensor that crossed goes back to its maker",
              'with timer("comm"):', "    crossing.backward(loss, crossing.take())")
            c("loss = None if loss is None else loss.detach()  # the graph was kept for glue that segments share "
              "(retain_graph): let it go before the next forward")
        if self.beside and len(last.ranks) > 1:
            c(f"if rank in {tuple(last.ranks[1:])}:  # every rank of the last group backpropagated the whole loss;",
              "    loss = None  # it counts once, on the first")

    def autocast(self, line: str) -> list[str]:
        """`line`, under autocast with precision bf16."""
        return ["with torch.autocast(device.type, dtype=torch.bfloat16):  # precision bf16", f"    {line}"] \
            if self.bf16 else [line]

    def forward_backward(self) -> None:
        c, segs = self.c, self.segs
        c("", "# forward, segment by segment", 'STATUS.at(step, "forward")')
        for seg in segs:
            self.forward(seg)
        self.loss(backward=True)
        c("", "# backward, segments in reverse: each sends its input's gradient back to the previous group")
        for seg in reversed(segs[1:]):
            self.backward(seg)

    def add_loss(self) -> None:
        """Hand the step's `total` to batch_losses (summed while the next step trains); a
        checkpoint waits for it, as it saves every loss so far."""
        c = self.c
        norm = ", grad_norm" if self.clip is not None else ""
        c(f"batch_losses.add(step, total{norm})  # summed off the critical path, a window of steps at a time; NaN/inf: stop")
        if self.checkpoint:
            c("if (step + 1) % CHECKPOINT_EVERY == 0:", "    batch_losses.settle()",
              f"    save_checkpoint(args.out, step, rank, modules, optimizers, losses{self.sched_arg}, model=model)")

    def gpipe_step(self) -> None:
        """GPipe on placer's own copies: every micro-batch forward, then every one backward. Each
        rank runs its part in that order and blocks only on its neighbours' messages, so stages
        overlap as in GPipe. Used where torch's schedules cannot go (stages of different data
        degrees, channel / tensor / spatial stages)."""
        c, segs, m = self.c, self.segs, self.microbatches
        last = segs[-1]
        saved = [f"a{s.k}" for s in segs[1:]] + [f"h{s.k}" for s in segs] + (
            ["out"] if last.loss_gather else []) + ["loss"]
        c("", f"# GPipe: every micro-batch forward, then every one backward; {m} micro-batches of "
              f"{segs[0].in_shape[0]} rows",
          f"xs, ys, saved = x.chunk({m}), y.chunk({m}), []",
          'STATUS.at(step, "forward")', f"for mb in range({m}):").indent()
        c("x, y = xs[mb], ys[mb]")
        for seg in segs:
            self.forward(seg)
        self.loss(backward=False)
        c(f"saved.append(({', '.join(saved)}))").dedent()
        c('STATUS.at(step, "backward")', "mb_losses = []", f"for mb in range({m}):").indent()
        c(f"{', '.join(saved)} = saved[mb]")
        self.loss_backward()
        for seg in reversed(segs[1:]):
            self.backward(seg)
        c("mb_losses.append(loss)").dedent()
        c("loss = None if mb_losses[0] is None else sum(mb_losses)  # this rank's share of the batch's loss")

    def loss(self, backward: bool) -> None:
        """The loss on the last group (and, with backward, its backward)."""
        c, last = self.c, self.segs[-1]
        out, whole = f"h{last.k}", f"Replicate({list(last.ranks[:1])})"
        if last.loss_gather:
            out = "out"
            c("", f"# the loss needs the whole output: the bands go to rank {last.ranks[0]}",
              f"# {self.layout_text(last)} -> rank {last.ranks[0]}, {list(last.out_shape)}", 'with timer("comm"):',
              f"    out = relayout(h{last.k}, {self.layout_arg(last)}, {whole}, {list(last.out_shape)},",
              f"                   route={self.route(last)}, device=device)")
            self.when(last.ranks[:1], "out.requires_grad_()")
        c("", "# loss: each rank's share of the global mean (rows / BATCH_SIZE), so gradients combine by SUM",
          *(['STATUS.at(step, "loss and backward")'] if backward else []), "loss = None")
        if last.replicated:
            c("# every rank of the last group holds the whole output: each backpropagates the whole loss")
            c("# (reaching its own slices of the parameters); it counts once, on the first")
        y = "y" if last.loss_gather else self.rows_of("y", last)
        line = f"loss = compute_loss({out}, {y}.to(device)) * ({self.rows(out, y)} / BATCH_SIZE)"
        if self.bf16:
            line = f"with torch.autocast(device.type, dtype=torch.bfloat16):  # precision bf16\n    {line}"
        self.when(last.ranks[:1] if out == "out" else last.ranks, *line.split("\n"),
                  *(["loss.backward()"] if backward else []))
        if backward:
            self.loss_backward(computed=True)

    def loss_backward(self, computed: bool = False) -> None:
        """Backward from the loss into the last segment (`computed`: loss.backward() already ran)."""
        c, last = self.c, self.segs[-1]
        whole = f"Replicate({list(last.ranks[:1])})"
        if not computed:
            c("if loss is not None:", "    loss.backward()")
        if last.replicated:
            counted = last.ranks[::len(last.ranks) // last.replicas]  # each replica's loss, once
            c(f"if rank in {tuple(r for r in last.ranks if r not in counted)}:", "    loss = None")
        if last.loss_gather:
            c("# the output's gradient back to the bands", 'with timer("comm"):',
              f"    d{last.k} = relayout_grad(out.grad if rank == {last.ranks[0]} else None, {self.layout_arg(last)}, "
              f"{whole},", f"                       {list(last.out_shape)}, route={self.route(last)}, device=device)")
            self.when(last.ranks, f"torch.autograd.backward(h{last.k}, d{last.k})")

    def forward(self, seg: Seg) -> None:
        c, k = self.c, seg.k
        if k == 0:
            x = self.rows_of("x", seg)
            self.forward_line(seg, f"{x}.to(device)")
            return
        prev = self.segs[k - 1]
        if self.relaid(prev, seg):
            c(f"# {self.layout_text(prev)} -> {self.layout_text(seg)}, {list(seg.in_shape)} in all", 'with timer("comm"):')
            c(f"    a{k} = relayout(h{k - 1}, {self.layout_arg(prev)}, {self.layout_arg(seg)}, {list(seg.in_shape)},",
              f"              {self.dtype_arg(seg)}route={self.route(seg)}, device=device)")
            if seg.grad_in:
                self.when(seg.ranks, f"a{k}.requires_grad_()")
        elif not seg.moved_in:
            c(f"# segment {k} reads segment {k - 1}'s output on the same rank(s): no copy")
            leaf = f"h{k - 1}.detach()" + (".requires_grad_()" if seg.grad_in else "")
            c(f"a{k} = {self.guarded(leaf, seg.ranks)}")
        else:
            c(f"# {self.transfer_text(prev.ranks, seg.ranks, seg.in_shape)}", 'with timer("comm"):')
            c(f"    a{k} = redistribute(h{k - 1}, {list(prev.ranks)}, {list(seg.ranks)}, {list(seg.in_shape)},",
              f"                      {self.dtype_arg(seg)}route={self.route(seg)}, device=device)")
            if seg.grad_in:
                self.when(seg.ranks, f"a{k}.requires_grad_()")
        self.forward_line(seg, f"a{k}")

    def forward_line(self, seg: Seg, arg: str) -> None:
        """`h{k} = seg{k}(arg)` on the segment's ranks. With precision bf16 under autocast, the
        output cast back to float32 to cross to the next segment (exact: autocast rounds it to
        bfloat16 again where the next layer wants that); the last segment's feeds the loss as is,
        but where its bands are gathered for the loss (the copy is of float32)."""
        c, call = self.c, self.call(seg, arg)
        c(*self.recompute_note(seg))
        if not self.bf16:
            c(f"h{seg.k} = {self.guarded(call, seg.ranks)}")
            return
        if (seg.k < len(self.segs) - 1 or seg.loss_gather) and seg.out_dtype == "float32":
            call += ".float()"
        c("with torch.autocast(device.type, dtype=torch.bfloat16):  # precision bf16",
          f"    h{seg.k} = {self.guarded(call, seg.ranks)}")

    def call(self, seg: Seg, arg: str) -> str:
        """Segment k's forward on `arg`: recomputed in backward where the spec says `recompute`;
        the first takes several named inputs by keyword."""
        arg = f"**{arg}" if self.named and seg.k == 0 else arg
        if not seg.recompute:
            return f"seg{seg.k}({arg})"
        # a mode whose forward communicates runs it all again, collectives included (early stop
        # would skip the last ones once every saved tensor is back): what the plan counts, on
        # every rank alike
        whole = ", early_stop=False" if MODES[seg.mode].forward_sends_activations else ""
        return f"torch.utils.checkpoint.checkpoint(seg{seg.k}, {arg}, use_reentrant=False{whole})"

    @staticmethod
    def recompute_note(seg: Seg) -> list[str]:
        return [f"# recompute: segment {seg.k} keeps only its input; backward runs its forward again"] \
            if seg.recompute else []

    def backward(self, seg: Seg) -> None:
        c, k = self.c, seg.k
        prev = self.segs[k - 1]
        if not seg.grad_in:
            c(f"# no gradient flows into segment {k - 1} (nothing before segment {k} trains)")
            return
        grad = self.guarded(f"a{k}.grad", seg.ranks)
        if self.relaid(prev, seg):
            c(f"# {self.layout_text(seg)} -> {self.layout_text(prev)} (gradient)", 'with timer("comm"):')
            c(f"    d{k - 1} = relayout_grad({grad}, {self.layout_arg(prev)}, {self.layout_arg(seg)},",
              f"                       {list(seg.in_shape)}, {self.dtype_arg(seg)}"
              f"route={self.route(seg)}, device=device)")
        elif not seg.moved_in:
            c(f"d{k - 1} = {grad}")
        else:
            c(f"# {self.transfer_text(seg.ranks, prev.ranks, seg.in_shape)} (gradient)", 'with timer("comm"):')
            c(f"    d{k - 1} = redistribute_grad({grad}, {list(prev.ranks)}, {list(seg.ranks)},",
              f"                           {list(seg.in_shape)}, {self.dtype_arg(seg)}route={self.route(seg)}, "
              "device=device)")
        note = "  # DDP sums the gradients over the group meanwhile" if data.uses_ddp(prev) else ""
        self.when(prev.ranks, f"torch.autograd.backward(h{k - 1}, d{k - 1}){note}")

    def sync(self, seg: Seg) -> None:
        """The gradient sync and optimizer step after backward, as the segment's mode writes them."""
        if not seg.has_params:
            return
        ranks, lines = MODES[seg.mode].emit_sync(seg)
        if self.lockstep and self.tied:  # replica pipelines: each tie's all-reduce has summed every copy
            tied = ", ".join(f"tied{i}" for i in range(len(self.tied)))
            lines = [line.replace(f"seg{seg.k}.parameters()", f"untied(seg{seg.k}.parameters(), {tied})")
                     for line in lines]
        if self.clip is not None:  # the steps come after the global norm (P092: sync helpers that step are refused)
            lines = [line for line in lines if line != f"opt{seg.k}.step()"]
        if lines:
            self.when(ranks, *lines)

    def finish(self) -> None:
        c = self.c
        c("seconds = time.perf_counter() - start")
        c("# the last step's gradients: not needed now, freed before the final parameters are gathered",
          "for m in modules:", "    m.zero_grad(set_to_none=True)")
        c("# the parameters are gathered whole (and each to rank 0) only when they will be written",
          f"finish(args, rank, world, losses, {self.own} if args.out else {{}}, seconds, simulated=simulate,",
          "       simulate_reason=why,",
          '       backend=backend.split(",")[-1].split(":")[-1])',
          "dist.barrier()  # no rank tears down gloo while a peer still talks to it",
          "dist.destroy_process_group()")

    # -- layouts: how a group holds the activations that enter and leave it ---------------------------
    @staticmethod
    def relaid(prev: Seg, seg: Seg) -> bool:
        """Whether the copy between two segments needs `relayout` (a replicated group, or a split
        along something other than rows) rather than the plain row-wise `redistribute`."""
        return seg.moved_in and any(s.replicated or s.split_dim for s in (prev, seg))

    @staticmethod
    def rows_of(batch: str, seg: Seg) -> str:
        """The part of the global `batch` (x or y) that segment seg's ranks take: all of it on one
        rank or a replicated group, a replica's rows in a 2-D one, else this rank's slice."""
        if seg.replicas > 1 and seg.split_dim:  # spatial x data: this rank's band of its replica's rows
            runs = tensor.runs(seg.ranks, seg.replicas)
            return (f"local_slice(replica_slice({batch}, {runs}, rank), next(r for r in {runs} if rank in r), rank, "
                    f"{seg.split_dim})")
        if seg.replicas > 1:
            return f"replica_slice({batch}, {tensor.runs(seg.ranks, seg.replicas)}, rank)"
        if len(seg.ranks) == 1 or seg.replicated:
            return batch
        return f"local_slice({batch}, {list(seg.ranks)}, rank{', ' + str(seg.split_dim) if seg.split_dim else ''})"

    @staticmethod
    def layout_arg(seg: Seg) -> str:
        """`Shard(dim, ranks)` (slices of dim over the ranks), `Replicate(ranks)` (whole on each)
        or `Replicas(ranks, n)` (n data replicas, each whole on its ranks)."""
        ranks, dim, replicated, replicas = seg.layout
        if replicas > 1:
            return f"Replicas({ranks}, {replicas}{f', {dim}' if dim else ''})"
        return f"Replicate({ranks})" if replicated or len(ranks) == 1 else f"Shard({dim}, {ranks})"

    @staticmethod
    def layout_text(seg: Seg) -> str:
        if len(seg.ranks) == 1:
            return ranks_text(seg.ranks)
        if seg.replicas > 1:
            within = f"bands of dim {seg.split_dim} within each" if seg.split_dim else "whole on each rank of one"
            return f"{ranks_text(seg.ranks)} ({seg.replicas} replicas: rows across them, {within})"
        if seg.replicated:
            return f"{ranks_text(seg.ranks)} (whole on each)"
        return f"{ranks_text(seg.ranks)} ({'rows' if seg.split_dim == 0 else f'bands of dim {seg.split_dim}'})"

    # -- descriptions -------------------------------------------------------------------------------
    def transfer_text(self, src, dst, shape) -> str:
        kind = ("copy" if len(dst) == 1 else "split") if len(src) == 1 else ("merge" if len(dst) == 1 else "re-split")
        rows = "" if kind == "copy" else " by rows (dim 0)"
        return f"{kind} {ranks_text(src)} -> {ranks_text(dst)}{rows}, {list(shape)} in all"

    def dtype_arg(self, seg: Seg) -> str:
        return "" if seg.in_dtype == "float32" else f"dtype=torch.{seg.in_dtype}, "


def train_source(segs: list[Seg], devices, cut: bool, checkpoint: bool, zero_args: str = "",
                 microbatches: int = 0, tied=(), lockstep: bool = False, training=None, schedule: str = "gpipe",
                 orders: dict[int, str] | None = None, named: bool = False, own_loss: bool = False) -> str:
    """`cut`: a module model cut into stages by torch.distributed.pipelining (`cut_model`);
    `lockstep`: one run in lockstep (runtime/lockstep.py); `training`: the spec's training
    options (lr_schedule, clip_grad_norm, accumulate, precision); `orders`: each rank's actions
    of a schedule other than gpipe, run as placer's loops (codegen/loops.py)."""
    return TrainWriter(segs, len(devices), devices, cut, checkpoint, zero_args, microbatches, tied,
                       lockstep, training, schedule, orders, named, own_loss).write()
