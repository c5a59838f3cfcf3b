"""Placer's own micro-batch loops in a pipeline schedule's order (1F1B, interleaved 1F1B, looped
BFS, zero bubble, V), for what torch's schedules cannot run: stages of different data degrees,
data stages with another sync, shard or sync_batchnorm, copies via host memory, channel / tensor
/ spatial stages beside stages of other modes or sizes; and module models in lockstep (one
micro-batch's forward per thread where a rank holds several stages).

Every rank of a stage's group walks the same actions, so the collectives inside a split stage
(tensor's all-reduces, spatial's halos) match across its ranks. A boundary copy is GPipe's
(`redistribute` by rows, or `relayout` where a side holds the whole activation on each rank or
bands of another dim), cut in two: the send half in the sending stage's action, the receive half
in the receiving one's.

Each rank walks its own list of actions (`order`: `0F0` = stage 0's forward of micro-batch 0, B
its backward, I / W a zero-bubble split of it), taken from torch's own generator
(`plan.schedules.action_orders`), the order the plan's schedule chart draws. A rank blocks only
where it needs its neighbours' data (it receives before it computes); every send is posted and
waited on at the end of the step (let go earlier once received), so no send holds a rank up.
Each stage copy's messages carry a tag per boundary, direction and micro-batch, so a rank with
several stages never takes one message for another; in lockstep (one stage per rank) each pair
sends and receives in the same order (forwards', then backwards' micro-batch order). Gradients
of the micro-batches accumulate in the order each rank runs its backwards, as on one device.
I runs the whole backward and W nothing: placer does not split a backward in two.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from placer.plan.schedules import SCHEDULES, action_orders

if TYPE_CHECKING:
    from placer.codegen.segments import Seg
    from placer.codegen.train import TrainWriter
    from placer.plan.ir import Plan


def rank_orders(plan: "Plan", devices) -> dict[int, str]:
    """rank -> its actions in order, as torch writes them (`0F0 0F1 0B0 ...`: stage, kind,
    micro-batch): each device group runs its stages' order."""
    groups: list[tuple] = []
    for s in plan.segments:
        if s.devices not in groups:
            groups.append(s.devices)
    assert plan.schedule
    orders = action_orders(plan.schedule, len(groups), len(plan.segments), plan.microbatches)
    return {devices.index(d): " ".join(map(str, order)) for g, order in enumerate(orders) for d in groups[g]}


def emit_order(w: "TrainWriter") -> None:
    """The constant `order`: this rank's actions."""
    cls = SCHEDULES[w.schedule].torch_class
    w.c("", "# this rank's actions, stage / F forward, B backward / micro-batch, in the order",
        f"# torch's {cls} runs them (the plan's schedule chart draws the same)",
        f"order = {w.orders!r}.get(rank, '').split()")


def head(w: "TrainWriter", what: str, sends: bool, *before: str) -> None:
    m = w.microbatches
    w.c("", f"# {w.schedule} {what}, this rank's actions in `order`:",
        "# a send is posted now and waited on at the end of the step, so none holds a rank up",
        f"xs, ys, saved{', sends' if sends else ''}, mb_losses = x.chunk({m}), y.chunk({m}), {{}}, "
        f"{'[], ' if sends else ''}[]", *before,
        "for action in order:").indent()
    w.c('kind = action.strip("0123456789")  # F, B (or I, W: backward for the input, for the weights)',
        "stage, mb = map(int, action.split(kind))",
        'STATUS.at(step, f"stage {stage} micro-batch {mb} " + ("forward" if kind == "F" else "backward"))')


def tail(w: "TrainWriter", *settle: str) -> None:
    w.c.dedent()(*settle, "loss = sum(mb_losses) if mb_losses else None  # this rank's share of the batch's loss")


def lockstep_step(w: "TrainWriter") -> None:
    """1F1B in lockstep (one segment per rank): F is the whole model's forward on a micro-batch,
    B this rank's backward of it (runtime/lockstep.py `backward_own`)."""
    c, last = w.c, w.segs[-1]
    head(w, "in lockstep (F: the whole model's forward of a micro-batch, B: this rank's backward of it)", False)
    c('if kind == "F":').indent()
    c(*w.autocast(f"out = {w.call_model('xs[mb].to(device)')}"), "loss = None")
    w.when(last.ranks, *w.autocast(f"loss = compute_loss(out, ys[mb].to(device)) * ({w.rows('out', 'ys[mb]')} / "
                                   "BATCH_SIZE)"))
    c("saved[mb] = (loss, crossing.take(wait=False))").dedent()
    c("else:").indent()
    c("loss, crossed = saved.pop(mb)", 'with timer("comm"):',
      "    crossing.backward_own(loss, crossed)  # receives the gradients of what it sent, sends those of what it got")
    w.when(last.ranks, "mb_losses.append(loss)")
    c.dedent()
    tail(w, "crossing.settle()  # every send of the step")
    _count_once(w)


def lockstep_stages_step(w: "TrainWriter") -> None:
    """A schedule where a rank holds several stages (interleaved, looped, V), in lockstep: each
    micro-batch's whole forward runs in a thread of its own that stops before the work of this
    rank's next stage (runtime/lockstep.py `forward_stage`); F lets it run through the stage, B
    (zero bubble: I) backpropagates the stage's part (`backward_stage`), W does nothing."""
    c, last = w.c, w.segs[-1]
    if w.bf16:  # autocast holds per thread: each micro-batch's forward thread enters it
        c("", "def forward(x):", f"    {AUTOCAST}", f"        return {w.call_model('x')}")
    elif w.named:  # the thread calls forward(x): several named inputs go by keyword
        c("", "def forward(x):", f"    return {w.call_model('x')}")
    head(w, "in lockstep (F: micro-batch mb's whole forward, run on through this stage's work; B: the stage's "
         "backward)", False)
    c('if kind == "F":').indent()
    c(f"out = crossing.forward_stage(stage, mb, {'forward' if w.bf16 or w.named else 'model'}, xs[mb].to(device))"
      "  # the model's output once it has run")
    w.when(last.ranks, f"if stage == {last.k}:",
           *("    " + line for line in w.autocast("saved[mb] = compute_loss(out, ys[mb].to(device)) * "
                                                 f"({w.rows('out', 'ys[mb]')} / BATCH_SIZE)")))
    c.dedent()
    c('elif kind in ("B", "I"):').indent()
    c(f"loss = saved.pop(mb) if stage == {last.k} else None", 'with timer("comm"):',
      "    crossing.backward_stage(stage, mb, loss)  # receives the gradients of what the stage sent, sends those "
      "of what it got")
    c("if loss is not None:", "    mb_losses.append(loss)")
    c.dedent()
    if any("W" in order for order in (w.orders or {}).values()):
        c('# kind "W": nothing; the I before it ran the whole backward')
    tail(w, "crossing.settle()  # every send of the step")
    _count_once(w)


def _count_once(w: "TrainWriter") -> None:
    """A split-mode group as the last stage (channel): each of its ranks backpropagated the whole
    loss; it counts once, on the first."""
    last = w.segs[-1]
    if w.beside and len(last.ranks) > 1:
        w.c(f"if rank in {tuple(last.ranks[1:])}:  # every rank of the last group backpropagated the whole loss;",
            "    loss = None  # it counts once, on the first")


def stage_step(w: "TrainWriter") -> None:
    """A schedule's order over stages of any data degree: each stage's forward receives its input
    (the receive half of the row-wise copy), runs, and posts its output to the next stage (the
    send half); its backward receives the output's gradient, backpropagates, and posts its
    input's back. Zero-bubble schedules' I runs the whole backward and W nothing: placer does not
    split a backward in two (the chart draws the split it would have)."""
    c, segs = w.c, w.segs
    split = any(k in order for order in (w.orders or {}).values() for k in "IW")  # zero bubble's
    head(w, "on placer's copies (stages of any data degree)", True,
         *(["turn = {}  # the V's turn: the input gradient of the stage after it, on the same ranks"]
           if any(not s.moved_in for s in segs[1:]) else []))
    for seg in segs:
        c(f'if (stage, kind) == ({seg.k}, "F"):').indent()(*_forward(w, seg)).dedent()
    for seg in segs:
        c(f'if stage == {seg.k} and kind in ("B", "I"):' if split else
          f'if (stage, kind) == ({seg.k}, "B"):').indent()(*_backward(w, seg)).dedent()
    if split:
        c('# kind "W": nothing; the I before it ran the whole backward')
    c("sends = [p for p in sends if not p.done()]  # let go of what was sent: its buffers hold activations")
    tail(w, "for posted in sends:  # every send of the step", "    posted.wait()")


def _tag(w: "TrainWriter", seg: "Seg", grad: bool) -> str:
    """The message tag of segment k's input (or its gradient) for micro-batch `mb`: a rank with
    several stages exchanges several kinds of message with one peer, each matched by its tag."""
    return f"{(2 * seg.k + grad) * w.microbatches} + mb"


def _copy(w: "TrainWriter", x: str, src: "Seg", dst: "Seg", grad: bool, pending: bool) -> str:
    """One half of the copy into `dst` (or of its gradient back, `grad`): the row-wise
    `redistribute`, or `relayout` where a side holds the whole activation on each rank (channel,
    tensor) or bands of another dim (spatial), exactly as GPipe's loops move it."""
    more = ", pending=sends" if pending else ""
    tail = f"route={w.route(dst)}, device=device{more}, tag={_tag(w, dst, grad)})"
    if w.relaid(src, dst):
        call = "relayout_grad" if grad else "relayout"
        return (f"{call}({x}, {w.layout_arg(src)}, {w.layout_arg(dst)}, {list(dst.in_shape)}, "
                f"{w.dtype_arg(dst)}{tail}")
    call = "redistribute_grad" if grad else "redistribute"
    return f"{call}({x}, {list(src.ranks)}, {list(dst.ranks)}, {list(dst.in_shape)}, {w.dtype_arg(dst)}{tail}"


def _moves(w: "TrainWriter", src: "Seg", dst: "Seg", grad: bool = False) -> str:
    """What the copy from `src` into `dst` (`grad`: of its gradient back) does, in words."""
    a, b = (dst, src) if grad else (src, dst)
    if w.relaid(src, dst):
        text = f"{w.layout_text(a)} -> {w.layout_text(b)}, {list(dst.in_shape)} in all"
    else:
        text = w.transfer_text(a.ranks, b.ranks, dst.in_shape)
    return text + (" (gradient)" if grad else "")


def _forward(w: "TrainWriter", seg: "Seg") -> list[str]:
    k, segs = seg.k, w.segs
    lines = [f"# segment {k}'s forward"]
    if k == 0:
        x = w.rows_of("xs[mb]", seg)  # (a 2-D stage's: its replica's rows, or their band)
        lines += ["a = None", *_compute(w, seg, f"{x}.to(device)")]
    else:
        prev = segs[k - 1]
        if seg.moved_in:
            lines += [f"# receive: {_moves(w, prev, seg)}", 'with timer("comm"):',
                      f"    a = {_copy(w, 'None', prev, seg, False, False)}"]
        else:
            lines += [f"# segment {k - 1}'s output, on these ranks too: no copy",
                      f"a = saved[{k - 1}, mb][1].detach()"]
        lines += ["a.requires_grad_()"] if seg.grad_in else []
        lines += _compute(w, seg, "a")
    if k < len(segs) - 1:
        nxt = segs[k + 1]
        if nxt.moved_in:
            lines += [f"# send (waited on at the end of the step): {_moves(w, seg, nxt)}",
                      'with timer("comm"):', f"    {_copy(w, 'h', seg, nxt, False, True)}"]
        return lines + [f"saved[{k}, mb] = (a, h, None)"]
    return lines + _loss(w, seg)


def _loss(w: "TrainWriter", seg: "Seg") -> list[str]:
    """The last stage's loss on a micro-batch: on each rank its rows' share; a group holding the
    whole output on each rank (channel, tensor) computes it on each, counted on the first; a
    spatial group's bands are gathered on its first rank first (within the group, in this action)."""
    lines, out = [], "h"
    if seg.loss_gather:
        out = "out"
        lines += [f"# the loss needs the whole output: {w.layout_text(seg)} -> rank {seg.ranks[0]}",
                  'with timer("comm"):',
                  f"    out = relayout(h, {w.layout_arg(seg)}, Replicate({list(seg.ranks[:1])}), "
                  f"{list(seg.out_shape)}, route={w.route(seg)}, device=device)",
                  f"if rank == {seg.ranks[0]}:", "    out.requires_grad_()"]
    y = "ys[mb]" if seg.loss_gather else w.rows_of("ys[mb]", seg)
    loss = f"loss = compute_loss({out}, {y}.to(device)) * ({w.rows(out, y)} / BATCH_SIZE)"
    loss_lines = [AUTOCAST, f"    {loss}"] if w.bf16 else [loss]
    lines += ["# loss: each rank's share of the global mean (rows / BATCH_SIZE), so gradients combine by SUM"]
    if seg.loss_gather:
        lines += ["loss = None", f"if rank == {seg.ranks[0]}:", *("    " + line for line in loss_lines)]
    else:
        lines += loss_lines
    return lines + [f"saved[{seg.k}, mb] = (a, h, loss{', out' if seg.loss_gather else ''})"]


AUTOCAST = "with torch.autocast(device.type, dtype=torch.bfloat16):  # precision bf16"


def _compute(w: "TrainWriter", seg: "Seg", arg: str) -> list[str]:
    """`h = seg{k}(arg)`; with precision bf16 under autocast, the output cast back to float32 to
    cross to the next stage (or to the loss's rank), as TrainWriter.forward_line does."""
    call = w.call(seg, arg)
    if not w.bf16:
        return [*w.recompute_note(seg), f"h = {call}"]
    if (seg.k < len(w.segs) - 1 or seg.loss_gather) and seg.out_dtype == "float32":
        call += ".float()"
    return [*w.recompute_note(seg), AUTOCAST, f"    h = {call}"]


def _backward(w: "TrainWriter", seg: "Seg") -> list[str]:
    k, segs = seg.k, w.segs
    out = ", out" if seg.loss_gather else ""
    lines = [f"# segment {k}'s backward", f"a, h, loss{out} = saved.pop(({k}, mb))"]
    if k == len(segs) - 1:
        lines += _loss_backward(w, seg)
    elif segs[k + 1].grad_in:
        nxt = segs[k + 1]
        if nxt.moved_in:
            lines += [f"# receive: {_moves(w, seg, nxt, grad=True)}",
                      'with timer("comm"):', f"    d = {_copy(w, 'None', seg, nxt, True, False)}"]
        else:
            lines += [f"d = turn.pop(mb)  # segment {k + 1}'s input gradient, on these ranks too"]
        lines += ["torch.autograd.backward(h, d)"]
    if k > 0 and seg.grad_in:
        prev = segs[k - 1]
        if seg.moved_in:
            lines += [f"# send (waited on at the end of the step): {_moves(w, prev, seg, grad=True)}",
                      'with timer("comm"):', f"    {_copy(w, 'a.grad', prev, seg, True, True)}"]
        else:
            lines += ["turn[mb] = a.grad"]
    return lines


def _loss_backward(w: "TrainWriter", seg: "Seg") -> list[str]:
    """Backward from the last stage's loss of a micro-batch (see _loss)."""
    if seg.loss_gather:
        return ["if loss is not None:", "    loss.backward()", "# the output's gradient back to the bands",
                'with timer("comm"):',
                f"    d = relayout_grad(out.grad if rank == {seg.ranks[0]} else None, {w.layout_arg(seg)}, "
                f"Replicate({list(seg.ranks[:1])}), {list(seg.out_shape)}, route={w.route(seg)}, device=device)",
                "torch.autograd.backward(h, d)", "if loss is not None:", "    mb_losses.append(loss)"]
    if seg.replicated:  # each rank backpropagates the whole loss into its slices; it counts once (a replica's)
        counted = seg.ranks[:: len(seg.ranks) // seg.replicas]
        return ["loss.backward()", f"if rank in {counted}:", "    mb_losses.append(loss)"]
    return ["loss.backward()", "mb_losses.append(loss)"]
