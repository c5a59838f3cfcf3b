# seed: a rank holds only what it owns. The first worker of each machine builds the whole model
# once from the seed and saves its tensors (a seed checkpoint, as torchtitan makes one); every
# rank builds the model on the meta device, which holds no memory, and gives only its own
# segments' parameters and buffers their values, read through a memory map of that file: equal
# to the one-device reference's bit for bit, and the rest of the model is never held.
import os
import tempfile
import uuid

import torch
import torch.distributed as dist


def seed_tensors(build, folder=None):
    """name -> seed value of every parameter and buffer of `build()` (non-persistent buffers
    too), memory-mapped: pages are read only where a rank copies them. The file lives in
    `folder` (the run directory) or the temporary folder, and is removed once every rank
    has mapped it."""
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)  # one name for the file, on every machine
    node = os.environ.get("GROUP_RANK", "0")
    path = os.path.join(folder or tempfile.gettempdir(), f"seed-{token[0]}-node{node}.pt")
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if first:
        model = build()
        tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        torch.save({name: t.detach() for name, t in tensors}, path)
        del model, tensors
    dist.barrier()
    try:
        seed = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    finally:
        dist.barrier()  # every rank of this machine has the file open: it can go
        if first:
            os.remove(path)
    return seed


def materialize(stage, model, seed, device):
    """`stage` (modules of `model`, built on the meta device) with its parameters and buffers
    copied from `seed` onto `device`; a tensor that several modules share stays one, in the
    model's other modules too (a parent's own parameter that a segment holds, which the
    parent's forward reads)."""
    made = {}
    _fill(stage.modules(), model, seed, device, made)
    _fill(model.modules(), model, seed, device, made, only_made=True)
    return stage


def materialize_rest(model, seed, device, layers, stages):
    """Lockstep: every rank runs the parent's forward, so what its glue reads (modules that no
    segment places, such as a rotary embedding; the parent's own tensors) takes its seed value
    on every rank. The placed layers of segments this rank lacks (`stages[k]` None; `layers`:
    name -> (segment, ...)) stay on the meta device: stand-ins run in their place."""
    away = tuple(name for name, (k, *_) in layers.items() if stages[k] is None)
    kept = {id(m): m for path, m in model.named_modules(remove_duplicate=False)
            if not any(path == n or path.startswith(n + ".") for n in away)}
    _fill(kept.values(), model, seed, device, {})


def _fill(modules, model, seed, device, made, only_made=False):
    """Each meta parameter and buffer held directly by `modules` replaced by the seed value of its
    name in `model` (one per tensor: `made`, id -> (meta tensor, value)), an empty one that has
    none (a constant export lifted out of a cut stage) by an empty tensor; with only_made, by
    those already made."""
    names = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), name)
    for module in modules:
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is None or not t.is_meta or (only_made and id(t) not in made):
                    continue
                if id(t) not in made:
                    src = seed.get(names[id(t)]) if not t.numel() else seed[names[id(t)]]
                    if src is None:  # an empty constant, no model tensor
                        value = torch.empty_like(t, device=device)
                    else:
                        value = torch.empty_like(src, device=device).copy_(src)  # not the mapped file's pages
                    if isinstance(t, torch.nn.Parameter):
                        value = torch.nn.Parameter(value, requires_grad=t.requires_grad)
                    made[id(t)] = (t, value)  # (t kept: its id stays its own)
                table[key] = made[id(t)][1]


def materialize_cut(stage, seed, device):
    """A stage that torch.distributed.pipelining cut from the model built on the meta device:
    each of its meta parameters and buffers takes the seed value of its name (stage modules keep
    the model's names; a tied parameter's copy in another stage, its own name there). A tensor
    the stage uses twice stays one. Constants that export lifts out of the forward (HF's empty
    cache tensors, `lifted_tensor_0`) are no model tensors: empty ones are made empty here."""
    missing = unseeded(stage, seed)
    if missing:
        raise RuntimeError(f"the cut stage's tensor {missing[0]!r} has no value in the seed: it is "
                           "not a parameter or buffer of the model under that name")
    _fill(stage.modules(), stage, seed, device, {})  # stage modules keep the model's names
    _retarget(stage, device)
    return stage


def unseeded(stage, names):
    """The names of a cut stage's meta parameters and buffers that have no seed value: neither a
    model tensor of that name (in `names`) nor empty (a constant export lifts out of the forward,
    such as HF's empty cache tensors). validate --deep and generate refuse a cut that has any."""
    return [f"{prefix}.{key}" if prefix else key
            for prefix, module in stage.named_modules(remove_duplicate=False)
            for table in (module._parameters, module._buffers) for key, t in table.items()
            if t is not None and t.is_meta and t.numel() and (f"{prefix}.{key}" if prefix else key) not in names]


def _retarget(stage, device):
    """Traced on the meta device, the stage's graphs name it where the forward makes or moves a
    tensor (`torch.arange(device=...)`, `.to(...)` in a rotary embedding): this rank's device
    instead."""
    def mine(a):
        return device if isinstance(a, torch.device) and a.type == "meta" else a

    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            node.args = torch.fx.node.map_aggregate(node.args, mine)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, mine)
        if isinstance(module, torch.fx.GraphModule):
            module.recompile()
