# lockstep: a module model whose segments sit on one device each, run without cutting its code.
# Every rank runs the whole model's forward (the parent's glue: embedding sums, masks, rotary);
# a placed layer runs only on its segment's rank. Elsewhere its call returns what crosses from
# that rank (where a layer here reads it, directly or through glue) or zeros of its traced shape
# (where nothing here does). A received tensor is a leaf here; backward runs segment by segment
# in reverse, the receivers sending each leaf's gradient back to the rank that made it.
# A group (tensor parallel) runs its segment's layers on each of its ranks, each on the whole
# input: what enters is sent to each, what leaves from the first, and its gradient to each; of
# what enters, all hold the same gradient and the first sends it back.
import collections

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


def run_as_chain(model, names, chain):
    """The model's forward runs a group's chain of layers (each reads only the one before it,
    P087) as `chain`, their split (ChannelSplit): the first layer's call runs the whole chain and
    the others hand their input on. A layer without parameters or buffers runs inside the chain
    itself, so the model gets an nn.Identity of its own in its place."""
    for i, name in enumerate(names):
        layer = model.get_submodule(name)
        if next(layer.parameters(), None) is None and next(layer.buffers(), None) is None:
            parent, _, attr = name.rpartition(".")
            layer = nn.Identity()
            setattr(model.get_submodule(parent), attr, layer)
        layer.forward = (lambda x: chain(x)) if i == 0 else (lambda x: x)  # functions, not submodules


class Lockstep:
    """`layers`: name -> (segment, rank, kind, leaves): where each placed layer runs and what its
    output is (kind tensor / tuple / list; leaves (shape, dtype) or None). `crossings`: (layer,
    leaf, from rank, to rank, route, gradient back), one per tensor and receiving rank, as the
    plan has them. `segments`: each segment's (first) rank. `groups`: the ranks of each segment
    over several (tensor parallel), which run its layers alike."""

    def __init__(self, model, rank, layers, crossings, segments, device, host=False, batch=None, groups=()):
        self.rank, self.device, self.layers, self.segments = rank, device, layers, segments
        self.batch = batch  # leaves traced with dim 0 == batch carry the rows of the call (micro-batches)
        self.group = {r: tuple(g) for g in groups for r in g}  # rank -> the ranks of its group
        self.out, self.into = collections.defaultdict(list), {}
        needs = {(name, leaf, r) for name, leaf, _, dst, _, grad in crossings if grad for r in self.ranks(dst)}
        for name, leaf, src, dst, route, grad in crossings:
            route = "via_host" if host else route  # gloo moves host tensors only
            if rank in self.ranks(src):  # the group's first sends; each gets the gradient back
                self.out[name, leaf].append((dst, route, grad, src == rank))
            if dst == rank:
                self.into[name, leaf] = (src, route, grad, (name, leaf, rank) in needs)
        for name, (_, owner, _, _) in layers.items():
            module = model.get_submodule(name)
            if rank in self.ranks(owner):
                module.register_forward_hook(self._send(name))
            else:  # an instance attribute: nn.Module.__call__ calls it instead of the class's forward
                module.forward = self._stand_in(name)
        self.sent, self.received, self.posted = [], [], []
        self.pending = []  # 1F1B: sends waited on at the end of the step (settle), so none blocks a rank
        self.rows = batch
        model.register_forward_pre_hook(self._rows)

    def ranks(self, rank):
        """The ranks of `rank`'s group (itself alone, outside a group)."""
        return self.group.get(rank, (rank,))

    def _rows(self, model, args):
        self.rows = args[0].shape[0]  # the rows of this forward's batch (a micro-batch's in GPipe)

    def _send(self, name):
        def hook(module, args, output):
            leaves = [output] if isinstance(output, torch.Tensor) else list(output)
            for i, t in enumerate(leaves):
                for dst, route, grad, sends in self.out.get((name, i), ()):
                    if sends:
                        posted = Posted(route)
                        posted.send(t.detach(), dst)
                        self.posted.append(posted)  # waited on after the forward: sends never block it
                    if grad and t.requires_grad:
                        self.sent.append((name, t, dst, route))
        return hook

    def _stand_in(self, name):
        segment, owner, kind, leaves = self.layers[name]

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
                src, route, grad, needs = self.into[name, i]
                posted = Posted(route)
                t = posted.recv(shape, dtype, src, self.device)
                posted.wait()
                t = t.to(self.device)
                if needs:  # a group's other ranks too: their backward runs the same collectives
                    t.requires_grad_()
                if grad:
                    self.received.append((name, t, src, route))
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
        until the step ends: a rank with two segments backpropagates through glue they share twice."""
        sent, received = crossed
        for k in reversed(range(len(self.segments))):
            posted, pairs = [], []
            for name, t, src, route in received:
                if self.layers[name][0] == k:
                    for to in self.ranks(src):
                        posted.append(Posted(route))
                        posted[-1].send(t.grad if t.grad is not None else torch.zeros_like(t), to)
            for name, t, dst, route in sent:
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
                torch.autograd.backward([t for t, _ in roots], [g for _, g in roots], retain_graph=True)

    def backward_own(self, loss, crossed):
        """1F1B, one segment per rank: this rank's backward of one forward (`crossed`, from take)
        alone. It receives the gradients of what it sent (summed per tensor), backpropagates from
        them and the loss, and posts the gradients of what it received to their makers without
        waiting (settle waits): a send never holds up this rank's next action."""
        sent, received = crossed
        posted, pairs = [], []
        for name, t, dst, route in sent:
            posted.append(Posted(route))
            pairs.append((t, posted[-1].recv(t.shape, t.dtype, dst, self.device)))
        for p in posted:
            p.wait()
        grads = {}  # one gradient per tensor: the sum over the ranks that read it
        for t, g in pairs:
            grads[id(t)] = (t, grads[id(t)][1] + g.to(self.device) if id(t) in grads else g.to(self.device))
        roots = list(grads.values()) + ([(loss, None)] if loss is not None else [])
        if roots:
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
        for name, t, src, route in received:
            p = Posted(route)
            p.send(t.grad if t.grad is not None else torch.zeros_like(t), src)
            self.pending.append(p)
        self.pending = [p for p in self.pending if not p.done()]  # let go of what was sent

    def settle(self):
        """Wait on every send left pending this step (their peers have received them all by now)."""
        for posted in self.pending:
            posted.wait()
        self.pending = []
