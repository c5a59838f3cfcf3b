"""The training options of the generated step (SPEC.md `training`): the global-norm clip
(`clip_grad_norm`), the scheduler steps (`lr_schedule`) and gradient accumulation
(`accumulate`), as lines `TrainWriter` writes into the step."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from placer.codegen.segments import Seg
from placer.modes import MODES, data

if TYPE_CHECKING:
    from placer.codegen.train import Code


class TrainingOptions:
    """Mixed into TrainWriter: uses its `c`, `segs`, `clip`, `scheduled`, `accumulate`,
    `microbatches` and `micro_step`."""
    c: Code
    segs: list[Seg]
    clip: Any
    scheduled: bool
    accumulate: int
    microbatches: int

    def micro_step(self) -> None: ...

    def norm_share(self, seg: Seg) -> None:
        """Segment k's part of `norm_params`: its slices on every rank, its whole parameters on one."""
        if self.clip is not None and seg.has_params:
            line = MODES[seg.mode].emit_norm_share(seg)
            leaders = tuple(seg.ranks[::len(seg.ranks) // seg.replicas])
            if seg.replicas > 1 and seg.shard == "full":  # FSDP2 over the replicas: each piece once
                self.c(MODES[seg.mode].emit_norm_share_sharded(seg, leaders))
            elif seg.replicas > 1:  # a 2-D segment's replicas hold the same gradients
                first = tuple(seg.ranks[:len(seg.ranks) // seg.replicas])
                self.c(f"if rank in {first}:  # counted on the first data replica", f"    {line}")
            else:
                self.c(line)

    @property
    def sched_arg(self) -> str:
        return ", schedulers" if self.scheduled else ""

    def clip_and_step(self) -> None:
        """With clip_grad_norm: the global norm over every rank's synced gradients, clipped, then
        every optimizer's step; and with lr_schedule every scheduler's step after its optimizer's."""
        c = self.c
        if self.clip is not None:
            c("", "# the global gradient norm (each parameter counted once, wherever it lives), clipped as",
              "# torch.nn.utils.clip_grad_norm_ does on one device; then every optimizer steps",
              'with timer("comm"):',
              "    grad_norm = clip_global_grad_norm(norm_params, [p for m in modules for p in m.parameters()], "
              "CLIP_GRAD_NORM)",
              "for opt in optimizers:", "    opt.step()")
        if self.scheduled:
            c("for scheduler in schedulers:  # training.lr_schedule: once per optimizer step", "    scheduler.step()")

    @property
    def syncs_in_backward(self) -> bool:
        """Whether a segment's gradients are summed during backward (DDP, FSDP2)."""
        return any(data.uses_ddp(s) or (s.shard == "full" and s.has_params and len(s.ranks) > 1) for s in self.segs)

    def accumulate_step(self) -> None:
        """training.accumulate: the step's batch in N micro-steps whose gradients add up in
        .grad (each loss is its rows' share of the whole batch's mean); DDP and FSDP2 sum
        over their group in the last micro-step's backward only, the other syncs follow it. With a
        pipeline each micro-step is a whole pipeline step over its micro-batches."""
        c, n = self.c, self.accumulate
        rows = f"{self.segs[0].in_shape[0]} rows" if not self.microbatches else \
            f"{self.microbatches} micro-batches each (a whole pipeline step)"
        c("", f"# accumulate: {n} micro-steps of {rows}, their gradients added up",
          f"micro_x, micro_y, micro_losses = x.chunk({n}), y.chunk({n}), []", f"for micro in range({n}):").indent()
        c("x, y = micro_x[micro], micro_y[micro]")
        if self.syncs_in_backward:
            c(f"with gradient_sync(modules, micro == {n - 1}):  # DDP / FSDP2 sum over their group: on the last").indent()
        self.micro_step()
        if self.syncs_in_backward:
            c.dedent()
        c("micro_losses.append(loss)").dedent()
        c("loss = None if micro_losses[0] is None else sum(micro_losses)  # this rank's share of the batch's loss")
