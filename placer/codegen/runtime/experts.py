# experts: expert parallelism. Each mixture of experts' stacked expert weights (Hugging Face's
# gate_up_proj / down_proj, [experts, ...]) are cut along dim 0, E / G experts per rank of the
# group; the experts module's forward sends each token to the rank of each expert it chose
# (an all-to-all), runs the module's own forward there on the experts it holds, and sends the
# results back (a second all-to-all) to be weighted and summed as the whole module sums them.
# Every token reaches its experts however uneven the routing: nothing is dropped. The
# all-to-alls are torch.distributed.nn's, so backward sends the gradients back the same way.
# The rest of the segment is data parallel: its gradients are summed over the group after
# backward (all_reduce_grads); an expert's gradient already sums every rank's tokens.
import functools
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from .buckets import all_reduce_grads

# (deprecated for the functional collectives, whose backward the byte counter cannot see)
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_to_all_single is deprecated")


def expert_parallelize(model, paths, group):
    """Cut each experts module at `paths` (names in `model`) over `group`: this rank keeps its
    run of E / G experts (every parameter whose dim 0 is the expert count) and dispatches
    tokens by all-to-all. Returns {name: parameter} of the expert slices this rank holds."""
    g, r = dist.get_world_size(group), dist.get_rank(group)
    held = {}
    for path in paths:
        m = model.get_submodule(path)
        e = m.num_experts
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dim() and p.shape[0] == e:  # this rank's experts, a copy (the whole is let go)
                part = torch.nn.Parameter(p.detach()[r * e // g:(r + 1) * e // g].clone(), p.requires_grad)
                setattr(m, name, part)
                held[f"{path}.{name}"] = part
        m.num_experts, m.ep_experts, m.ep_group = e // g, e, group
        m.ep_forward = m.forward  # the module's own: it runs the experts this rank holds
        m.forward = functools.partial(dispatched, m)
    return held


def dispatched(self, hidden, top_k_index, top_k_weights):
    """The experts module's forward over the group: tokens (T, H) with their top-k experts and
    weights (T, k) in, the weighted sum of their experts' outputs (T, H) out."""
    group, e, k = self.ep_group, self.ep_experts, top_k_index.shape[-1]
    g = dist.get_world_size(group)
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # each (token, choice) by expert: ranks in order
    token = order // k
    counts = torch.bincount(flat, minlength=e)  # rows for each expert from this rank
    got = torch.empty_like(counts)  # rows for each of this rank's experts from each rank
    dist.all_to_all_single(got, counts, group=group)
    send, recv = counts.view(g, -1).sum(1).tolist(), got.view(g, -1).sum(1).tolist()
    rows = dist_nn.all_to_all_single(hidden.new_empty(sum(recv), hidden.shape[-1]), hidden[token],
                                     recv, send, group=group)
    # the local expert of each row received: sources in order, each source's rows by expert
    local = torch.arange(e // g, device=hidden.device).repeat(g).repeat_interleave(got)
    out = self.ep_forward(rows, local[:, None], torch.ones(len(rows), 1, dtype=hidden.dtype, device=hidden.device))
    back = dist_nn.all_to_all_single(hidden.new_empty(len(token), out.shape[-1]), out, send, recv, group=group)
    weights = top_k_weights.reshape(-1)[order, None]
    # summed per token in expert order, as the whole module adds its experts' outputs
    return torch.zeros_like(hidden).index_add(0, token, (back * weights).to(hidden.dtype))


@torch.no_grad()
def expert_sync(dense, experts, group, bucket_mb=25.0):
    """After backward: the dense parameters' gradients summed over the group; an expert slice
    that no token reached this step gets a zero gradient, as its rows of the whole weight do."""
    for p in experts:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_grads(dense, group, bucket_mb)


@torch.no_grad()
def experts_whole(t, group):
    """An expert slice's whole value (its rank's run of experts gathered along dim 0)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts)


def expert_grads(named, experts, group, keep):
    """WHOLE_GRADS' entries for an expert segment's parameters (`named`): an expert slice's
    first gradient gathered whole as experts_whole gathers its value, the others as they are."""
    def whole(t):
        return experts_whole(t, group)
    return {n: (p, keep, whole) if n in experts else (p, keep) for n, p in named.items()}
