# tensor: Megatron-style tensor parallelism with torch's DTensor styles. The plan names the
# Linear pairs of a segment (a Linear, then elementwise or Dropout layers only, then another
# Linear): the first is split by output features (ColwiseParallel), the second by input
# features (RowwiseParallel), and the layers between run on each rank's slice of the
# features. The pair needs one all-reduce forward (the second's partial sums) and one
# backward (the first's input gradient); DTensor inserts both. Every other layer runs whole
# on every rank. Input and output are the whole tensor on every rank ("replicated", see
# replicate.py). The mesh is made from the segment's own process group, so a tensor group
# may be any subset of the world; this works on CPU with gloo.
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module


class OnSlices(nn.Module):
    """An elementwise layer between a pair's halves, run on this rank's slice of the features
    (DTensor has no sharding rule for the backward of some, e.g. Hardshrink, LogSigmoid)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        y = self.layer(x.to_local())
        return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=x.stride())


def tensor_parallelize(module, group, pairs, device_type="cpu"):
    """Split module's Linear pairs [(column child, row child)] over the ranks of group, in place
    (the layers keep their names; their parameters become DTensors). `group` may be a DeviceMesh
    (a 2-D one's tp dim). Every rank of the group calls it; ranks outside the group do not."""
    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device_type)
    plan = {}
    names = [name for name, _ in module.named_children()]
    for col, row in pairs:
        # DTensor between the two (not local shards) keeps uneven splits' true shape
        plan[col] = ColwiseParallel(use_local_output=False)
        plan[row] = RowwiseParallel()
        for name in names[names.index(col) + 1:names.index(row)]:
            setattr(module, name, OnSlices(getattr(module, name)))
    parallelize_module(module, mesh, plan)
    for _, row in pairs:  # after parallelize_module's own hooks, which start the all-reduce
        module.get_submodule(row).register_forward_hook(_all_reduced)


def _all_reduced(module, args, out):
    """Wait for a row half's output all-reduce now. RowwiseParallel starts it asynchronously and
    it is waited on where the output is first read; a rank that never reads it (the next segment
    runs on other ranks) left each step's output in torch's registry of unwaited collectives:
    256 KiB a step on the bench's tensor spec, for the whole run."""
    if isinstance(out, AsyncCollectiveTensor):
        out.trigger_wait()


HEAD_ATTRS = ("n_heads", "n_head", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads")


def tensor_parallelize_blocks(model, group, groups, device_type="cpu"):
    """Split a model's transformer blocks over the ranks of group, in place: each group
    (("attn.q", "attn.k", "attn.v"), "attn.proj") is its column halves (split by output features, so
    each rank runs 1/d of the heads on the whole input) and its row half (split by input
    features; its partial sums all-reduced). The module holding its columns runs 1/d of the heads:
    its head counts are divided (the model reads them to reshape). Every rank of the group calls it."""
    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device_type)
    plan = {}
    for cols, row in groups:
        plan.update({col: ColwiseParallel() for col in cols})
        plan[row] = RowwiseParallel()
        path = cols[0].rpartition(".")[0]  # the module running the heads: the columns' (BERT's attention.self)
        holder = model.get_submodule(path)
        heads = {getattr(holder, a) for a in HEAD_ATTRS if isinstance(getattr(holder, a, None), int)}
        for name in head_tables(holder, heads):  # its rows of values per head go with the heads
            plan[f"{path}.{name}"] = ColwiseParallel()
        for attr in HEAD_ATTRS:
            if isinstance(getattr(holder, attr, None), int):
                setattr(holder, attr, getattr(holder, attr) // mesh.size())
    parallelize_module(model, mesh, plan)


def head_tables(holder, heads):
    """The children of an attention module that hold a value per head and position: an Embedding
    as wide as its head count (T5's relative_attention_bias, [buckets, heads]). Split by columns,
    each rank looks up the bias of its own heads."""
    return [name for name, m in holder.named_children() if isinstance(m, nn.Embedding) and m.embedding_dim in heads]


def whole_params(named):
    """{name: whole tensor} of {name: parameter}: DTensors (tensor parallel, FSDP) gathered
    with full_tensor(), a collective over each one's mesh (every rank of it calls, in the
    same order); plain tensors as they are."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in named.items()}


def unsharded_state_dict(module):
    """module.state_dict() with every DTensor (tensor parallel or FSDP) gathered whole, under
    the same names. A collective over each DTensor's mesh: every rank of it calls."""
    return whole_params(module.state_dict())


def replica_slice(x, replicas, rank):
    """The rows of x that the data replica holding `rank` computes (replicas: lists of ranks,
    rows cut evenly across them in order): a 2-D segment's."""
    i = next(i for i, run in enumerate(replicas) if rank in run)
    size = x.shape[0] // len(replicas)
    return x.narrow(0, i * size, size)


def _locals(tensors):
    """Each tensor, a DTensor as its local piece."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _slices(tensors, op, write_back=True):
    """op(flat) on the tensors (a DTensor's local slice) in one flat message, copied back unless not `write_back`."""
    local = _locals(tensors)
    flat = torch.cat([t.reshape(-1) for t in local])
    op(flat)
    if write_back:
        for t, v in zip(local, flat.split([t.numel() for t in local])):
            t.copy_(v.view_as(t))


@torch.no_grad()
def all_reduce_slices(module, group):
    """SUM each parameter's gradient over group, the ranks that hold the same slices in every
    data replica of a 2-D segment, in one flat message."""
    _slices([p.grad for p in module.parameters()], lambda f: dist.all_reduce(f, group=group))


@torch.no_grad()
def reduce_slices(module, group, root):
    """`sync: broadcast` after backward: rank root (global, the first replica's in group) ends
    with the SUM of group's gradients of the slices, which it alone then steps."""
    _slices([p.grad for p in module.parameters()], lambda f: dist.reduce(f, root, group=group),
            write_back=dist.get_rank() == root)


@torch.no_grad()
def broadcast_slices(module, group, root):
    """`sync: broadcast` before the forward: every rank of group ends with root's slices."""
    _slices(list(module.parameters()), lambda f: dist.broadcast(f, root, group=group))


class SliceServer:
    """`sync: parameter_server` on a 2-D segment. The server rank keeps a copy of every slice
    position's slices (its own position's too, when it is one of the segment's ranks) and the only
    optimizer, over those copies. After backward each position's gradients are summed onto it
    (one flat message over groups[p]: the position's ranks and the server), it steps every copy,
    and sends each position its updated slices back (one flat message). `module` is this rank's
    split segment (None on a server outside it); every rank of any group constructs it, in the
    same order, under no counting: set-up copies each position's first slices to the server."""

    def __init__(self, module, groups, positions, server, make_optimizer):
        self.rank, self.server, self.groups, self.positions = dist.get_rank(), server, groups, positions
        self.params = list(module.parameters()) if module is not None else []
        self.mine = next((i for i, ranks in enumerate(positions) if self.rank in ranks), None)
        self.copies, self.optimizer = [], None
        copies = self._gather()
        if self.rank == server:
            self.copies = [[nn.Parameter(t) for t in c] for c in copies]
            self.optimizer = make_optimizer([t for c in self.copies for t in c])

    def _gather(self):
        """On the server, every position's slices as it holds them now (a list per position);
        elsewhere []. Every rank of any group calls it."""
        got = []
        for p, ranks in enumerate(self.positions):
            if self.server in ranks or self.rank not in (self.server, *ranks):
                continue  # (the server copies its own slices below)
            src, group = ranks[0], self.groups[p]
            shapes = [[tuple(t.shape) for t in _locals(self.params)]]
            dist.broadcast_object_list(shapes, src=src, group=group)
            flat = torch.cat([t.detach().reshape(-1) for t in _locals(self.params)]) if self.params else \
                torch.empty(sum(torch.Size(s).numel() for s in shapes[0]))
            dist.broadcast(flat, src, group=group)
            if self.rank == self.server:
                got.append((p, [v.view(s).clone() for v, s in zip(
                    flat.split([torch.Size(s).numel() for s in shapes[0]]), shapes[0])]))
        if self.rank == self.server and self.mine is not None:
            got.append((self.mine, [t.detach().clone() for t in _locals(self.params)]))
        return [c for _, c in sorted(got, key=lambda pc: pc[0])]

    @torch.no_grad()
    def fetch(self):
        """A resumed run (every rank of any group calls it): the server's copies from the slices the
        positions loaded from the checkpoint, in place, so the loaded optimizer state still fits them."""
        for copy, loaded in zip(self.copies, self._gather()):
            for t, v in zip(copy, loaded):
                t.copy_(v)

    @torch.no_grad()
    def step(self):
        """Call on every rank of any group after backward: the sums up, the step, the slices back."""
        if self.rank == self.server:
            for p, group in enumerate(self.groups):
                mine = p == self.mine
                flat = torch.cat([g.reshape(-1) for g in _locals([q.grad for q in self.params])]) if mine else \
                    torch.zeros(sum(t.numel() for t in self.copies[p]))
                dist.reduce(flat, self.server, group=group)
                for t, v in zip(self.copies[p], flat.split([t.numel() for t in self.copies[p]])):
                    t.grad = v.view_as(t)
            self.optimizer.step()
            for p, group in enumerate(self.groups):
                flat = torch.cat([t.reshape(-1) for t in self.copies[p]])
                dist.broadcast(flat, self.server, group=group)
                if p == self.mine:
                    for t, c in zip(_locals(self.params), self.copies[p]):
                        t.copy_(c)
        elif self.mine is not None:
            group = self.groups[self.mine]
            _slices([q.grad for q in self.params], lambda f: dist.reduce(f, self.server, group=group),
                    write_back=False)
            _slices(self.params, lambda f: dist.broadcast(f, self.server, group=group))

    @torch.no_grad()
    def grads_back(self):
        """run --check only (not training traffic): each rank's gradients become the sums the server
        stepped, for the first-step comparison."""
        for p, group in enumerate(self.groups):
            if self.rank == self.server:
                flat = torch.cat([t.grad.reshape(-1) for t in self.copies[p]])
                dist.broadcast(flat, self.server, group=group)
                if p == self.mine:
                    for g, c in zip(_locals([q.grad for q in self.params]), self.copies[p]):
                        g.copy_(c.grad.view_as(g))
            elif p == self.mine:
                _slices([q.grad for q in self.params], lambda f: dist.broadcast(f, self.server, group=group))


def norm_share_2d(module, tp_first):
    """FSDP2 x TP: the parameters whose gradients this rank counts in the global norm. A piece
    sharded on both mesh dims (FSDP2's _StridedShard over a column split included) is this rank's
    alone; a piece replicated over tp (a row half's
    bias, a layer tensor parallel leaves whole: sharded over dp only) is counted on the ranks
    at tp position 0 (`tp_first`)."""
    return [p for p in module.parameters() if tp_first or (
        p.device_mesh.ndim == 2 and not any(placement.is_replicate() for placement in p.placements))]
