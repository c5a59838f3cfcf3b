"""Placer's own micro-batch loops in a pipeline schedule's order (1F1B), for what torch's
schedules cannot run: stages of different data degrees, data stages with another sync, shard
or sync_batchnorm, copies via host memory, and module models in lockstep.

Each rank walks its own list of actions (`order`: F = a stage's forward of a micro-batch, B =
its backward), taken from torch's own generator (`plan.schedules.action_orders`), the order the
plan's schedule chart draws. A rank blocks only where it needs its neighbours' data (it
receives before it computes); every send is posted and waited on at the end of the step, so no
send holds a rank up, and each pair of ranks sends and receives its messages in the same order
(activations in the forwards' micro-batch order, gradients in the backwards'). Gradients of the
micro-batches accumulate in the order each rank runs its backwards, as on one device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from placer.plan.schedules import SCHEDULES, action_orders

if TYPE_CHECKING:
    from placer.codegen.segments import Seg
    from placer.codegen.train import TrainWriter
    from placer.plan.ir import Plan


def rank_orders(plan: "Plan", devices) -> dict[int, str]:
    """rank -> its actions in order, as `F0 F1 B0 ...` (kind and micro-batch): each device group
    runs its stage's order. Only schedules with one stage per group are written this way."""
    assert plan.schedule and SCHEDULES[plan.schedule].layout == "single", plan.schedule
    groups: list[tuple] = []
    for s in plan.segments:
        if s.devices not in groups:
            groups.append(s.devices)
    orders = action_orders(plan.schedule, len(groups), len(plan.segments), plan.microbatches)
    return {devices.index(d): " ".join(f"{a.kind}{a.microbatch}" for a in order)
            for g, order in enumerate(orders) for d in groups[g]}


def emit_order(w: "TrainWriter") -> None:
    """The constant `order`: this rank's actions."""
    cls = SCHEDULES[w.schedule].torch_class
    w.c("", "# this rank's forwards (F) and backwards (B) of each micro-batch, in the order",
        f"# torch's {cls} runs them (the plan's schedule chart draws the same)",
        f"order = {w.orders!r}.get(rank, '').split()")


def head(w: "TrainWriter", what: str, sends: bool) -> None:
    m = w.microbatches
    w.c("", f"# {w.schedule} {what}, this rank's actions in `order`:",
        "# a send is posted now and waited on at the end of the step, so none holds a rank up",
        f"xs, ys, saved{', sends' if sends else ''}, mb_losses = x.chunk({m}), y.chunk({m}), {{}}, "
        f"{'[], ' if sends else ''}[]",
        "for action in order:").indent()
    w.c("kind, mb = action[0], int(action[1:])",
        'STATUS.at(step, f"micro-batch {mb} " + ("forward" if kind == "F" else "backward"))')


def tail(w: "TrainWriter", *settle: str) -> None:
    w.c.dedent()(*settle, "loss = sum(mb_losses) if mb_losses and mb_losses[0] is not None else None  "
                 "# this rank's share of the batch's loss")


def lockstep_step(w: "TrainWriter") -> None:
    """1F1B in lockstep (one segment per rank): F is the whole model's forward on a micro-batch,
    B this rank's backward of it (runtime/lockstep.py `backward_own`)."""
    c, last = w.c, w.segs[-1]
    head(w, "in lockstep (F: the whole model's forward of a micro-batch, B: this rank's backward of it)", False)
    c('if kind == "F":').indent()
    c("out = model(xs[mb].to(device))", "loss = None")
    w.when(last.ranks, "loss = compute_loss(out, ys[mb].to(device)) * (out.shape[0] / BATCH_SIZE)")
    c("saved[mb] = (loss, crossing.take(wait=False))").dedent()
    c("else:").indent()
    c("loss, crossed = saved.pop(mb)", 'with timer("comm"):',
      "    crossing.backward_own(loss, crossed)  # receives the gradients of what it sent, sends those of what it got",
      "mb_losses.append(loss)").dedent()
    tail(w, "crossing.settle()  # every send of the step")


def stage_step(w: "TrainWriter") -> None:
    """1F1B over stages of any data degree: each stage's forward receives its input (the receive
    half of the row-wise copy), runs, and posts its output to the next stage (the send half);
    its backward receives the output's gradient, backpropagates, and posts its input's back."""
    c, segs = w.c, w.segs
    head(w, "on placer's copies (stages of any data degree)", True)
    c('if kind == "F":').indent()
    for seg in segs:
        w.when(seg.ranks, *_forward(w, seg))
    c.dedent()("else:").indent()
    for seg in segs:
        w.when(seg.ranks, *_backward(w, seg))
    c.dedent()
    tail(w, "for posted in sends:  # every send of the step", "    posted.wait()")


def _copy(w: "TrainWriter", x: str, src: "Seg", dst: "Seg", grad: bool, pending: bool) -> str:
    """One half of the row-wise copy into `dst` (or of its gradient back, `grad`)."""
    call = "redistribute_grad" if grad else "redistribute"
    more = ", pending=sends" if pending else ""
    return (f"{call}({x}, {list(src.ranks)}, {list(dst.ranks)}, {list(dst.in_shape)}, {w.dtype_arg(dst)}"
            f"route={w.route(dst)}, device=device{more})")


def _forward(w: "TrainWriter", seg: "Seg") -> list[str]:
    k, segs = seg.k, w.segs
    assert not any(w.relaid(a, b) for a, b in zip(segs, segs[1:])) and not segs[-1].loss_gather
    lines = [f"# segment {k}'s forward"]
    if k == 0:
        x = "xs[mb]" if len(seg.ranks) == 1 else f"local_slice(xs[mb], {list(seg.ranks)}, rank)"
        lines += ["a = None", *w.recompute_note(seg), f"h = {w.call(seg, f'{x}.to(device)')}"]
    else:
        prev = segs[k - 1]
        lines += [f"# receive: {w.transfer_text(prev.ranks, seg.ranks, seg.in_shape)}", 'with timer("comm"):',
                  f"    a = {_copy(w, 'None', prev, seg, False, False)}"]
        lines += ["a.requires_grad_()"] if seg.grad_in else []
        lines += [*w.recompute_note(seg), f"h = {w.call(seg, 'a')}"]
    if k < len(segs) - 1:
        nxt = segs[k + 1]
        lines += [f"# send (waited on at the end of the step): {w.transfer_text(seg.ranks, nxt.ranks, nxt.in_shape)}",
                  'with timer("comm"):', f"    {_copy(w, 'h', seg, nxt, False, True)}", "loss = None"]
    else:
        y = "ys[mb]" if len(seg.ranks) == 1 else f"local_slice(ys[mb], {list(seg.ranks)}, rank)"
        lines += ["# loss: each rank's share of the global mean (rows / BATCH_SIZE), so gradients combine by SUM",
                  f"loss = compute_loss(h, {y}.to(device)) * (h.shape[0] / BATCH_SIZE)"]
    return lines + ["saved[mb] = (a, h, loss)"]


def _backward(w: "TrainWriter", seg: "Seg") -> list[str]:
    k, segs = seg.k, w.segs
    lines = [f"# segment {k}'s backward", "a, h, loss = saved.pop(mb)"]
    if k == len(segs) - 1:
        lines += ["loss.backward()"]
    elif segs[k + 1].grad_in:
        nxt = segs[k + 1]
        lines += [f"# receive: {w.transfer_text(nxt.ranks, seg.ranks, nxt.in_shape)} (gradient)",
                  'with timer("comm"):', f"    d = {_copy(w, 'None', seg, nxt, True, False)}",
                  "torch.autograd.backward(h, d)"]
    if k > 0 and seg.grad_in:
        prev = segs[k - 1]
        lines += [f"# send (waited on at the end of the step): {w.transfer_text(seg.ranks, prev.ranks, seg.in_shape)}"
                  " (gradient)", 'with timer("comm"):', f"    {_copy(w, 'a.grad', prev, seg, True, True)}"]
    return lines + ["mb_losses.append(loss)"]
