# lockstep: a module model whose segments sit on one device each, run without cutting its code.
# Every rank runs the whole model's forward (the parent's glue: embedding sums, masks, rotary);
# a placed layer runs only on its segment's rank. Elsewhere its call returns what crosses from
# that rank (where a layer here reads it, directly or through glue) or zeros of its traced shape
# (where nothing here does). A received tensor is a leaf here; backward runs segment by segment
# in reverse, the receivers sending each leaf's gradient back to the rank that made it. With
# data-parallel segments, each replica pipeline (the r-th rank of every segment) runs this on its
# slice of the batch, talking to its own peers only; the groups all-reduce gradients after it.
# A group of a split mode (tensor, channel, spatial) beside one-device segments runs its segment's
# layers on each of its ranks, each on the whole input: what enters is sent to each, what leaves
# from the first, and its gradient to each; of what enters, all hold the same gradient and the
# first sends it back.
# A rank holding several stages (interleaved, looped, V schedules) runs each micro-batch's forward
# in a thread of its own that stops before its next stage's work until the schedule's action for
# that stage lets it go on (`forward_stage`); one thread runs at a time, so every message is
# posted in the schedule's order, each tagged with its tensor, direction and micro-batch.
import collections
import queue
import sys
import threading

import torch
import torch.nn as nn

from .transfer import Posted


def segment_module(model, names):
    """The segment's layers (and the parent's own parameters it owns) under the model's names,
    in empty containers: its optimizer steps exactly them, and they are saved as the model
    names them."""
    stage = nn.Module()
    for name in names:
        *path, last = name.split(".")
        parent = stage
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        try:
            parent.add_module(last, model.get_submodule(name))
        except AttributeError:  # a parameter of the parent's
            parent.register_parameter(last, model.get_parameter(name))
    return stage


def convert_layers(model, names, convert):
    """The placed layers `names` of the model as `convert` makes them (SyncBatchNorm over a data
    group), in the model itself: its forward calls them. Returns the model."""
    for name in names:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, convert(model.get_submodule(name)))
    return model


def run_as_chain(model, names, chain):
    """The model's forward runs a group's chain of layers (each reads only the one before it,
    P087) as `chain`, their split (ChannelSplit): the first layer's call runs the whole chain and
    the others hand their input on. A layer without parameters or buffers runs inside the chain
    itself, so the model gets an nn.Identity of its own in its place. So does an FSDP2 unit (a
    spatial chain's whole Conv, which the chain calls as a module so that its hooks gather and
    reduce-scatter it): the model's call must not run its hooks too (nor, through the forward set
    here, the chain again); the stand-in shares the unit's parameter and buffer tables (FSDP2
    swaps sharded and gathered tensors in them), so the model still names them."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # (a layer cannot be FSDP2's before it is imported)
    for i, name in enumerate(names):
        layer = model.get_submodule(name)
        unit = fsdp is not None and isinstance(layer, fsdp.FSDPModule)
        if unit or next(layer.parameters(), None) is None and next(layer.buffers(), None) is None:
            parent, _, attr = name.rpartition(".")
            layer, held = nn.Identity(), layer
            if unit:
                layer._parameters, layer._buffers = held._parameters, held._buffers
            setattr(model.get_submodule(parent), attr, layer)
        layer.forward = (lambda x: chain(x)) if i == 0 else (lambda x: x)  # functions, not submodules


class Lockstep:
    """`layers`: name -> (segment, kind, leaves): where each placed layer runs and what its
    output is (kind tensor / tuple / list; leaves (shape, dtype) or None). `crossings`: (layer,
    leaf, from rank, to rank, route, gradient back), one per tensor and receiving rank, as the
    plan has them. `pipelines`: each replica pipeline's rank per segment (a group's first); this
    rank's is run. `groups`: the ranks of each segment of a split mode over several, which run its
    layers alike (beside one-device segments: one pipeline)."""

    def __init__(self, model, rank, layers, crossings, pipelines, device, host=False, batch=None, groups=()):
        self.group = {r: tuple(g) for g in groups for r in g}  # rank -> the ranks of its group
        # this pipeline's rank per segment (a group's first)
        self.segments = next(p for p in pipelines if any(rank in self.ranks(r) for r in p))
        self.rank, self.device, self.layers = rank, device, layers
        self.batch = batch  # leaves traced with dim 0 == batch carry the rows of the call (micro-batches)
        self.out, self.into = collections.defaultdict(list), {}
        needs = {(name, leaf, r) for name, leaf, _, dst, _, grad in crossings if grad for r in self.ranks(dst)}
        for i, (name, leaf, src, dst, route, grad) in enumerate(crossings):
            route = "via_host" if host else route  # gloo moves host tensors only
            if rank in self.ranks(src):  # a group's first sends; each gets the gradient back
                self.out[name, leaf].append((dst, route, grad, i, src == rank))
            if dst == rank:  # needs: a group's other ranks too, whose backward runs the same collectives
                self.into[name, leaf] = (src, route, grad, i, (name, leaf, rank) in needs)
        self.held = [k for k, r in enumerate(self.segments) if rank in self.ranks(r)]
        for name, (segment, _, _) in layers.items():
            module = model.get_submodule(name)
            if rank in self.ranks(self.segments[segment]):
                module.register_forward_pre_hook(lambda m, args, k=segment: self._gate(k))
                module.register_forward_hook(self._send(name))
            else:  # an instance attribute: nn.Module.__call__ calls it instead of the class's forward
                module.forward = self._stand_in(name)
        self.sent, self.received, self.posted = [], [], []
        self.pending = []  # 1F1B: sends waited on at the end of the step (settle), so none blocks a rank
        self.rows = batch
        # first: a 2-D tensor group's ranks cut their replica's rows of the batch (bands.py)
        model.register_forward_pre_hook(self._rows, prepend=True, with_kwargs=True)
        # several stages on this rank: micro-batch -> the last stage its forward may run, its
        # thread's go-ahead, what it sent and received; the threads' reports (paused, done, error)
        self.mb, self.allowed, self.go, self.crossed, self.reports = 0, None, {}, {}, queue.Queue()

    def ranks(self, rank):
        """The ranks of `rank`'s group (itself alone, outside a group)."""
        return self.group.get(rank, (rank,))

    def _rows(self, model, args, kwargs):
        # the rows of this forward's batch (a micro-batch's in GPipe); several named inputs come by keyword
        self.rows = (args[0] if args else next(iter(kwargs.values()))).shape[0]

    def _tag(self, i, grad):
        """Crossing i's message (or its gradient's) for the running micro-batch: tagged only where
        a rank holds several stages, so one pair's messages of different stages never mix."""
        return (2 * i + grad) * 1024 + self.mb if self.allowed is not None else 0

    def _stage(self, name):
        """The stage of this rank whose work receives what `name` sends here: its first after the
        layer's segment (where this rank's forward reaches the layer's stand-in)."""
        return next(k for k in self.held if k > self.layers[name][0])

    def _gate(self, stage):
        """Several stages on this rank: the running micro-batch's forward waits here until the
        schedule's action for `stage` lets it go on."""
        if self.allowed is None:
            return
        mb = self.mb
        while stage > self.allowed[mb]:
            self.reports.put(("paused", None))
            self.go[mb].get()

    def _send(self, name):
        kind, traced = self.layers[name][1], self.layers[name][2]

        def hook(module, args, output):
            leaves = [output] if isinstance(output, torch.Tensor) else list(output)
            cast = False
            for i, t in enumerate(leaves):
                dtype = getattr(torch, traced[i][1]) if traced[i] is not None else None
                if self.out.get((name, i)) and dtype is not None and t.dtype != dtype:
                    # it crosses as one device holds it (the plan's dtype, learnt under autocast);
                    # where that was not learnt, as traced (float32), which autocast rounds again
                    t = leaves[i] = t.to(dtype)
                    cast = True
                for dst, route, grad, x, sends in self.out.get((name, i), ()):
                    if sends:
                        posted = Posted(route)
                        posted.send(t.detach(), dst, tag=self._tag(x, False))
                        self.posted.append(posted)  # waited on after the forward: sends never block it
                    if grad and t.requires_grad:
                        self.sent.append((name, t, dst, route, x))
            if cast:
                return leaves[0] if kind == "tensor" else tuple(leaves) if kind == "tuple" else leaves
        return hook

    def _stand_in(self, name):
        _, kind, leaves = self.layers[name]

        def forward(*args, **kwargs):
            out = []
            for i, leaf in enumerate(leaves):
                if leaf is None:
                    out.append(None)
                    continue
                shape, dtype = list(leaf[0]), getattr(torch, leaf[1])
                if shape and shape[0] == self.batch:
                    shape[0] = self.rows
                if (name, i) not in self.into:  # nothing on this rank reads it
                    out.append(torch.zeros(shape, dtype=dtype, device=self.device))
                    continue
                src, route, grad, x, needs = self.into[name, i]
                if self.allowed is not None:
                    self._gate(self._stage(name))
                posted = Posted(route)
                t = posted.recv(shape, dtype, src, self.device, tag=self._tag(x, False))
                posted.wait()
                t = t.to(self.device)
                if needs:  # a group's other ranks too: their backward runs the same collectives
                    t.requires_grad_()
                if grad:
                    self.received.append((name, t, src, route, x))
                out.append(t)
            return out[0] if kind == "tensor" else tuple(out) if kind == "tuple" else out
        return forward

    def take(self, wait=True):
        """What this forward sent and received (its sends waited on, or with wait=False left for
        settle), for its backward."""
        for posted in self.posted:
            posted.wait() if wait else self.pending.append(posted)
        crossed = (self.sent, self.received)
        self.sent, self.received, self.posted = [], [], []
        return crossed

    def backward(self, loss, crossed):
        """Backward of one forward (`crossed`, from take) over every segment, last first: the ranks
        holding a segment's tensors send their gradients back, its rank sums them per tensor and
        backpropagates from them (and from the loss, on the last segment's rank). Graphs stay
        until this rank's last backward: a rank with two segments backpropagates through glue they
        share twice; that last one frees each saved tensor as it goes, as a plain backward does."""
        sent, received = crossed
        for k in reversed(range(len(self.segments))):
            posted, pairs = [], []
            for name, t, src, route, _ in received:
                if self.layers[name][0] == k:
                    for to in self.ranks(src):
                        posted.append(Posted(route))
                        posted[-1].send(t.grad if t.grad is not None else torch.zeros_like(t), to)
            for name, t, dst, route, _ in sent:
                if self.layers[name][0] == k:
                    posted.append(Posted(route))
                    pairs.append((t, posted[-1].recv(t.shape, t.dtype, dst, self.device)))
            for p in posted:
                p.wait()
            if self.rank not in self.ranks(self.segments[k]):
                continue
            grads = {}  # one gradient per tensor: the sum over the ranks that read it
            for t, g in pairs:
                grads[id(t)] = (t, grads[id(t)][1] + g.to(self.device) if id(t) in grads else g.to(self.device))
            roots = list(grads.values()) + ([(loss, None)] if k == len(self.segments) - 1 and loss is not None else [])
            if roots:
                torch.autograd.backward([t for t, _ in roots], [g for _, g in roots], retain_graph=k != self.held[0])

    def backward_own(self, loss, crossed):
        """1F1B, one segment per rank: this rank's backward of one forward (`crossed`, from take)
        alone; a send never holds up this rank's next action."""
        self._backward(crossed, loss)
        self.pending = [p for p in self.pending if not p.done()]  # let go of what was sent

    def _backward(self, crossed, loss, stage=None, retain_graph=False):
        """Receive the gradients of what was sent (by `stage`, or by any), summed per tensor;
        backpropagate them and the loss; post the gradients of what was received (by `stage`)
        to their makers without waiting (settle waits)."""
        sent, received = crossed
        posted, pairs = [], []
        for name, t, dst, route, x in sent:
            if stage is None or self.layers[name][0] == stage:
                posted.append(Posted(route))
                pairs.append((t, posted[-1].recv(t.shape, t.dtype, dst, self.device, tag=self._tag(x, True))))
        for p in posted:
            p.wait()
        grads = {}  # one gradient per tensor: the sum over the ranks that read it
        for t, g in pairs:
            grads[id(t)] = (t, grads[id(t)][1] + g.to(self.device) if id(t) in grads else g.to(self.device))
        roots = list(grads.values()) + ([(loss, None)] if loss is not None else [])
        if roots:
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots], retain_graph=retain_graph)
        for name, t, src, route, x in received:
            for to in self.ranks(src) if stage is None or self._stage(name) == stage else ():
                p = Posted(route)
                p.send(t.grad if t.grad is not None else torch.zeros_like(t), to, tag=self._tag(x, True))
                self.pending.append(p)

    def forward_stage(self, stage, mb, model, x):
        """Several stages on this rank: the action F of `stage` on micro-batch mb. The micro-batch's
        forward (the whole model's, in a thread of its own, started at its first stage) runs until
        it reaches the work of a later stage of this rank, or its end; this waits for that. Returns
        the model's output once the forward has ended, else None."""
        if self.allowed is None:
            self.allowed = {}
        self.mb, self.allowed[mb] = mb, stage
        if mb not in self.go:
            self.go[mb], self.crossed[mb] = queue.Queue(), ([], [])
            self.sent, self.received = self.crossed[mb]
            # autocast is per thread: the forward's thread takes the caller's (precision bf16)
            cast = (x.device.type, torch.get_autocast_dtype(x.device.type), torch.is_autocast_enabled(x.device.type))
            threading.Thread(target=self._forward, args=(model, x, cast), daemon=True).start()
        else:
            self.sent, self.received = self.crossed[mb]
            self.go[mb].put(None)
        report, value = self.reports.get()  # one thread runs at a time: this one, until it stops
        self.pending += self.posted  # sends: waited on at the end of the step
        self.posted = []
        if report == "error":
            raise value
        if report == "done":
            del self.go[mb]
            return value
        return None

    def _forward(self, model, x, cast):
        try:
            with torch.autocast(cast[0], dtype=cast[1], enabled=cast[2]):
                out = model(x)
            self.reports.put(("done", out))
        except BaseException as e:  # raised again by the schedule's thread
            self.reports.put(("error", e))

    def backward_stage(self, stage, mb, loss):
        """Several stages on this rank: the action B (or I) of `stage` on micro-batch mb. Receives
        the gradients of what the stage sent, backpropagates them (and the loss, on the last
        stage), and posts the gradients of what the stage received to their makers."""
        self.mb = mb
        # graphs stay until the micro-batch's last stage here: stages may share glue
        self._backward(self.crossed[mb], loss, stage, retain_graph=stage != self.held[0])
        if stage == self.held[0]:
            del self.crossed[mb]
        self.pending = [p for p in self.pending if not p.done()]  # let go of what was sent

    def settle(self):
        """Wait on every send left pending this step (their peers have received them all by now)."""
        if self.go:  # a schedule lacking an F action of some stage here: never train on half a forward
            raise RuntimeError(f"the forwards of micro-batches {sorted(self.go)} did not reach their end this step")
        for posted in self.pending:
            posted.wait()
        self.pending = []
