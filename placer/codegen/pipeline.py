"""The generated program's `train(args)` for a spec with `pipeline:`: the segments become
stages of torch.distributed.pipelining, and one torch schedule (GPipe, 1F1B, interleaved,
zero-bubble, ...) runs every micro-batch's forward and backward and their sends.

With data-parallel stages (every stage on d devices) there are d pipelines: pipeline j is
the j-th rank of every stage's group and takes slice j of every micro-batch. After the
schedule's step each stage's gradients are summed over its group, then every stage steps.
The schedule gets a loss that is the micro-batch mean times its share of the global batch
(`pipeline_loss`, scale_grads=False), so the summed gradients are the one-device ones.
"""
from __future__ import annotations

from placer.codegen import ties
from placer.codegen.segments import Seg
from placer.codegen.train import TrainWriter
from placer.modes import MODES


def pipelines(segs: list[Seg]) -> list[list[int]]:
    """Pipeline j's ranks in stage-owner order (group rank i of its process group runs the
    stages at position i). Every layout the validator accepts (one stage per group,
    round-robin, V) has its distinct groups first in stage order, so position i is the
    i-th distinct group."""
    groups: list[tuple[int, ...]] = []
    for s in segs:
        if s.ranks not in groups:
            groups.append(s.ranks)
    return [[g[j] for g in groups] for j in range(len(segs[0].ranks))]


class PipelineWriter(TrainWriter):
    steps_all = True

    def __init__(self, segs: list[Seg], world: int, devices, cut: bool, checkpoint: bool, schedule: str,
                 microbatches: int, tied=(), training=None):
        super().__init__(segs, world, devices, cut, checkpoint, tied=tied, training=training)
        self.schedule, self.microbatches = schedule, microbatches
        self.pipelines = pipelines(segs)
        self.degree = len(segs[0].ranks)
        self.replicated = segs[0].replicated
        """Every stage channel / tensor parallel: pipeline j is the j-th rank of every stage's group,
        all pipelines carry the same (whole) micro-batches, and each stage's collectives run
        within its group."""

    def setup_segment(self, seg: Seg) -> None:
        c, k = self.c, seg.k
        c("", f"# {self.describe(seg)}")
        if self.replicated:
            c(f"g{k} = dist.new_group({list(seg.ranks)}, timeout=timedelta(seconds=TIMEOUT_S))  # the stage's {seg.mode} split runs over this group")
        elif self.degree > 1:
            c(f"g{k} = dist.new_group({list(seg.ranks)}, timeout=timedelta(seconds=TIMEOUT_S))  # its gradients are summed over this group")
        c(f"seg{k} = opt{k} = None")
        self.c(f"if {self.cond(seg.ranks)}:").indent()
        if self.replicated:
            c(f"stage = {self.placed(f'{seg.func}(model)')}", *MODES[seg.mode].emit_stage(seg, self.checkpoint))
            if seg in self.gathered:  # split parameters: their first-step gradients gathered whole
                c(*MODES[seg.mode].emit_whole_grads(seg))
            if seg.has_params:
                c(f"opt{k} = make_optimizer(seg{k}.parameters())")
            self.norm_share(seg)
            c.dedent()
            return
        if self.cut:
            c(f"model, pipe = cut_model({seg.rows})", f"seg{k} = materialize_cut({seg.func}(model, pipe), seed, device)")
        else:
            c(f"seg{k} = {self.placed(f'{seg.func}(model)')}")
        if seg.has_params:
            if self.degree > 1:
                c(f"if rank == {seg.owner}:", f"    own.update(named_params(seg{k}, model))")
            else:
                c(f"own.update(named_params(seg{k}, model))")
            c(f"opt{k} = make_optimizer(seg{k}.parameters())")
        self.norm_share(seg)
        if seg.recompute:
            c(f"seg{k} = Recomputed(seg{k})  # recompute: backward runs the stage's forward again")
        if self.bf16:
            c(f"seg{k} = Autocast(seg{k})  # precision bf16: the stage's forward under autocast, its output float32")
        c.dedent()

    def setup(self) -> None:
        super().setup()
        c, n = self.c, len(self.segs)
        c("", f"# the pipeline: {n} stages, {self.microbatches} micro-batches, schedule {self.schedule!r}")
        if self.replicated:
            c(f"# {self.degree} pipelines, one per rank of the stages' groups: each carries the whole micro-batches")
        elif self.degree > 1:
            c(f"# {self.degree} pipelines, one per data replica: pipeline j is the j-th rank of every stage's group")
        c(f"PIPELINES = {self.pipelines}  # each pipeline's ranks; group rank i runs the stages at position i",
          "pp_groups = [pipeline_group(ranks, timeout=timedelta(seconds=TIMEOUT_S)) for ranks in PIPELINES]  # every rank creates every group",
          "j = next(i for i, ranks in enumerate(PIPELINES) if rank in ranks)  # this rank's pipeline",
          f"mine = {{s: m for s, m in enumerate({self.tuple_of('seg')}) if m is not None}}  # stage index -> module",
          *self.stage_shapes(),
          f"stages = pipeline_stages(mine, {n}, pp_groups[j], device{', STAGE_SHAPES' if self.shapes_known else ''})",
          f"schedule = make_pipeline_schedule({self.schedule!r}, stages, {self.microbatches}, "
          f"{'autocast_loss(compute_loss)' if self.bf16 else 'compute_loss'}, BATCH_SIZE)")

    @property
    def shapes_known(self) -> bool:
        return all(s.in_shape and s.out_shape for s in self.segs)

    def stage_shapes(self) -> list[str]:
        """STAGE_SHAPES: what each stage takes and gives per micro-batch, from the plan's shapes."""
        if not self.shapes_known:
            return ["# (shapes unknown: torch infers them at the first step)"]
        io = {s.k: (((s.rows, *s.in_shape[1:]), s.in_dtype), ((s.rows, *s.out_shape[1:]), s.out_dtype))
              for s in self.segs}
        return ["# per micro-batch of one pipeline: ((input shape, dtype), (output shape, dtype)) of each stage",
                f"STAGE_SHAPES = {io!r}"]

    def step(self) -> None:
        c, last = self.c, len(self.segs) - 1
        c('STATUS.at(step, "data")  # what this rank is doing, for placer run\'s report if a rank hangs',
          'with timer("data"):', "    x, y = next(data)  # the whole batch of this step, on every rank",
          "for m in modules:", "    m.zero_grad(set_to_none=True)")
        n = self.accumulate
        if n > 1:  # the schedule never zeroes .grad: its steps add up there
            c("", f"# accumulate: {n} micro-steps, each a whole schedule step over {self.microbatches} micro-batches, "
                  "their gradients added up",
              f"micro_x, micro_y, micro_losses = x.chunk({n}), y.chunk({n}), []", f"for micro in range({n}):").indent()
            c("x, y = micro_x[micro], micro_y[micro]")
        if self.degree > 1 and not self.replicated:
            c(f"# pipeline j's rows: slice j (of {self.degree}) of every micro-batch",
              f"x = pipeline_local_batch(x, {self.microbatches}, {self.degree}, j)",
              f"y = pipeline_local_batch(y, {self.microbatches}, {self.degree}, j)")
        c("", "# every micro-batch's forward and backward, in the schedule's order; stages send",
          "# activations and gradients to their neighbours. Returns this rank's summed micro-batch",
          "# losses (0 unless it holds the last stage).",
          'STATUS.at(step, "forward and backward (pipeline schedule)")',
          f"loss = pipeline_step(schedule, x.to(device) if 0 in mine else None, y.to(device) if {last} in mine else None)")
        if n > 1:
            c("micro_losses.append(loss)").dedent()
            c("loss = sum(micro_losses)  # this rank's share of the batch's loss")
        c('STATUS.at(step, "gradient sync and optimizer step")')
        if self.degree > 1 and not self.replicated:
            c("", "# every stage's gradients summed over its data group")
            for seg in self.segs:
                if seg.has_params:
                    self.when(seg.ranks, 'with timer("comm"):',
                              f"    all_reduce_grads(seg{seg.k}.parameters(), g{seg.k}, bucket_mb={seg.bucket_mb!r})")
        c(*ties.emit_sync(self.tied))
        if self.clip is None:
            c("for opt in optimizers:", "    opt.step()")
        self.clip_and_step()
        c("", "# the loss of the whole batch: ranks without the last stage add 0")
        if self.replicated:
            c("# (every pipeline computes the same losses: pipeline 0's count)",
              "total = (loss if j == 0 else torch.zeros(())).float().cpu()")
        else:
            c("total = loss.float().cpu()")
        self.add_loss()

    def describe(self, seg: Seg) -> str:
        layers = seg.layers[0] if len(seg.layers) == 1 else f"{seg.layers[0]}..{seg.layers[-1]}"
        where = ", ".join(self.devices[r] for r in seg.ranks)
        text = f"stage {seg.k} {seg.name!r} ({layers}) on {where}"
        if self.replicated:
            text += f": {seg.mode} split over {len(seg.ranks)} ranks, whole micro-batches on each"
        elif len(seg.ranks) > 1:
            text += f": data parallel, {seg.rows} rows of every micro-batch on each"
        return text


def pipeline_train_source(segs: list[Seg], devices, cut: bool, checkpoint: bool, schedule: str,
                          microbatches: int, tied=(), training=None) -> str:
    return PipelineWriter(segs, len(devices), devices, cut, checkpoint, schedule, microbatches, tied,
                          training).write()

