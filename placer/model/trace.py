"""Trace a model on the meta device: per-layer shapes, FLOPs and saved bytes.

One forward runs on meta tensors (no weight or activation memory is spent)
with forward hooks on the placeable layers, a `FlopCounterMode`, autograd's
`saved_tensors_hooks` and a `TorchFunctionMode` watching root parameters.
Where the model traces with `torch.fx` (placeable layers as leaves), that
forward is `ShapeProp` over the fx graph, which also gives the data edges
between layers; otherwise (`nn.MultiheadAttention` in the root's forward,
control flow on shapes, ...) the module itself runs under the same hooks.

Attribution is by time: work and saved tensors between two layers (an
`x + pos` in the root's forward) count for the layer that runs next, the one
whose segment consumes it (SPEC.md); work after the last layer counts for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import ShapeProp, _extract_tensor_metadata
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from placer.model.graph import INPUT, OUTPUT


@dataclass
class LayerTrace:
    """What one placeable layer did in the traced forward (first call's shapes)."""

    name: str
    in_shape: tuple | None = None
    in_bytes: int = 0
    out_shape: tuple | None = None
    out_dtype: str = "float32"
    out_bytes: int = 0
    flops: int = 0
    saved_bytes: int = 0
    saves_input: bool = False
    saves_output: bool = False
    saved_keys: set = field(default_factory=set)
    """Storages saved for backward while this layer ran (its own ops')."""
    grad_ops: list = field(default_factory=list)
    """Per op of its first call that makes a new tensor needing a gradient: (bytes of its output's
    and its inputs' gradients, bytes it saved, its outputs' storages)."""
    inner_grad_bytes: int = 0
    """LayerInfo.inner_grad_bytes."""
    calls: int = 0
    input_keys: frozenset = frozenset()
    out_kind: str = "tensor"
    """The output's structure: tensor, tuple or list (of tensors and None), or other."""
    out_leaves: tuple = ()
    """Per leaf of the output: (shape, dtype name, requires_grad), or None for a None leaf."""
    consumers: dict = field(default_factory=dict)
    """Output leaf index -> the layers (or `output`) whose inputs it reaches through work owned by
    no layer (the parent's glue): what crosses where those run elsewhere."""
    read_outside: tuple = ()
    """(its parameter or buffer, the layer or None for the parent's glue) where work outside the
    layer's own forward first read the layer's tensors' values (`x @ self.embed.weight.T`)."""


@dataclass
class TraceResult:
    order: list[str]
    """Layers in order of their first call; layers never called are absent."""
    layers: dict[str, LayerTrace]
    output: object
    """The model's output (meta tensors)."""
    traced_with: str
    """fx (ShapeProp over an fx graph) or hooks."""
    inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """fx only: the layers (or `input`) whose tensors reach each layer's inputs."""
    root_consumers: dict[str, str] = field(default_factory=dict)
    """Root parameter/buffer name -> the layer whose segment consumes it."""
    root_users: dict[str, set] = field(default_factory=dict)
    """Root parameter name -> every layer (or `output`) its value reaches through glue."""
    homes: dict[str, tuple] = field(default_factory=dict)
    """Layer -> where its inputs are made, cut at layer boundaries (`_Recorder.input_homes`)."""
    glue_before: frozenset = frozenset()
    """Layers right before whose call the parent's glue made a tensor (work owned by no layer)."""
    calls: tuple = ()
    """Every call of a layer (not inside another), in order: a layer called twice is there twice."""
    linear_reads: dict[str, tuple] = field(default_factory=dict)
    """Layer -> (path inside it, input number, feeder, rows x positions read, whether its input
    gets a gradient) of each Linear's first call, in call order (`_LinearReads`): what `tensor`
    pairs by data flow across sibling modules, and the sizes of its all-reduces."""


class ForwardFailed(Exception):
    """The meta forward raised; `layer` is the innermost placeable layer running then."""

    def __init__(self, cause: BaseException, layer: str | None):
        super().__init__(str(cause))
        self.cause, self.layer = cause, layer


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _structure(output) -> tuple[str, list]:
    """(kind, leaves): a tensor, or a tuple / list of tensors and None, as the program rebuilds
    it where the layer runs elsewhere; anything else is `other`."""
    if isinstance(output, torch.Tensor):
        return "tensor", [output]
    if type(output) in (tuple, list) and all(x is None or isinstance(x, torch.Tensor) for x in output):
        return type(output).__name__, list(output)
    return "other", _tensors(output)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor):
    # Meta tensors have no data_ptr; the StorageImpl address tells views of one
    # storage apart from other storages (the tensors stay alive until the trace ends).
    try:
        return t.untyped_storage()._cdata
    except Exception:  # tensor subclasses without a plain storage
        return ("id", id(t))


class _LayerTracer(fx.Tracer):
    """An fx tracer that keeps placeable layers opaque (one call_module node each)."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m, qualname):
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


def fx_graph(module: torch.nn.Module, layers: list[str]) -> fx.GraphModule | None:
    """The model as an fx graph with placeable layers as leaves, or None if it does not trace."""
    try:
        graph = _LayerTracer(set(layers)).trace(module)
        return fx.GraphModule(module, graph)
    except Exception:  # any user forward may defeat symbolic tracing; hooks still work
        return None


def layer_inputs(gm: fx.GraphModule, layers: set[str]) -> dict[str, tuple[str, ...]]:
    """For each layer node, the layers or `input` its arguments come from, through unowned work."""
    out: dict[str, tuple[str, ...]] = {}
    pos = {n.target if n.op == "call_module" else INPUT: i for i, n in reversed(list(enumerate(gm.graph.nodes)))
           if n.op in ("call_module", "placeholder")}
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target not in layers:
            continue
        found, stack, seen = [], list(node.all_input_nodes), set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if "tensor_meta" not in n.meta:  # shape-only uses (x.size(1)) carry no data
                continue
            src = n.target if n.op == "call_module" and n.target in layers else INPUT if n.op == "placeholder" else None
            if src is not None:
                found.append(src)
            else:
                stack += n.all_input_nodes
        prev = out.get(node.target, ())
        # a layer called twice gets the sources of both calls, in graph order
        out[node.target] = prev + tuple(s for s in dict.fromkeys(sorted(found, key=pos.__getitem__)) if s not in prev)
    return out


class _ShapeProp(ShapeProp):
    """torch's ShapeProp without the traceback it prints when a node fails (hooks take over then)."""

    def run_node(self, n: fx.Node):
        result = fx.Interpreter.run_node(self, n)
        found = []

        def meta(obj):
            if isinstance(obj, torch.Tensor):
                found.append(obj)
                return _extract_tensor_metadata(obj)
            return obj

        tensor_meta = map_aggregate(result, meta)
        if found:
            n.meta["tensor_meta"] = tensor_meta
        n.meta["type"] = type(result)
        return result


class _Recorder(TorchFunctionMode):
    """Attributes FLOPs, saved tensors and root-parameter uses to the running layer."""

    def __init__(self, layers: dict[str, torch.nn.Module], root_params: dict[int, str], skip_storages: set,
                 root_tensors=()):
        super().__init__()
        self.traces = {name: LayerTrace(name) for name in layers}
        # id(parameter or buffer) -> (the layers holding it, its name in the first)
        self.layer_tensors: dict[int, tuple[set, str]] = {}
        for name, m in layers.items():
            for n, t in [*m.named_parameters(), *m.named_buffers()]:
                self.layer_tensors.setdefault(id(t), (set(), f"{name}.{n}"))[0].add(name)
        self.order: list[str] = []
        self.stack: list[str] = []
        self.pending = LayerTrace("")  # work outside any layer, for the next layer
        self.pending_roots: list[str] = []
        self.root_params = root_params
        self.root_consumers: dict[str, str] = {}
        self.seen_storages = set(skip_storages)  # parameters and buffers are not activations
        self.param_storages = frozenset(skip_storages)
        self.in_sdpa = 0
        self.keep: list[torch.Tensor] = []
        self.flops = FlopCounterMode(display=False)
        self.mark = 0
        # data flow through glue: id(tensor) -> {(layer, leaf) or ("root", name)} it derives from
        self.sources: dict[int, frozenset] = {id(t): frozenset({("root", n)}) for t, n in root_tensors}
        self.root_users: dict[str, set] = {}
        # where each layer's inputs were made: a layer's output, the model input, or glue run
        # before the n-th layer call (a cut at layer boundaries puts that glue in that layer's stage)
        self.calls: list[str] = []
        self.made: dict[int, int] = {}
        self.made_by: dict[int, str] = {}
        self.input_ids: set[int] = set()
        self.linear_reads = _LinearReads(layers)  # each Linear's input inside the layers
        self.alls: list = []  # results of torch.all on meta data, kept alive
        self.homes: dict[str, list] = {}
        self.hooking = False
        self.glue_reads: dict[int, list] = {}  # n -> where what glue before the n-th call reads was made

    def _made_where(self, obj) -> list:
        return [self.made_by.get(id(x), INPUT if id(x) in self.input_ids else self.made.get(id(x)))
                for x in _tensors(obj)]

    def _sources(self, obj) -> frozenset:
        return frozenset().union(*(self.sources.get(id(t), frozenset()) for t in _tensors(obj)))

    def consume(self, obj, consumer: str) -> None:
        """`consumer` (a layer, or the model output) reads `obj`: record what it derives from."""
        for src in self._sources(obj):
            if src[0] == "root":
                self.root_users.setdefault(src[1], set()).add(consumer)
            else:
                self.traces[src[0]].consumers.setdefault(src[1], set()).add(consumer)

    # -- where work goes
    def _target(self) -> LayerTrace:
        return self.traces[self.stack[-1]] if self.stack else self.pending

    def _settle_flops(self):
        total = self.flops.get_total_flops()
        self._target().flops += total - self.mark
        self.mark = total

    def _flush_pending(self, trace: LayerTrace):
        trace.flops += self.pending.flops
        trace.saved_bytes += self.pending.saved_bytes
        self.pending = LayerTrace("")
        for name in self.pending_roots:
            self.root_consumers.setdefault(name, trace.name)
        self.pending_roots = []

    # -- module hooks
    def _quiet(self, hook):
        """The hook, with the tensor attributes it reads kept out of the glue's data flow."""
        def quiet(*args):
            self.hooking = True
            try:
                return hook(*args)
            finally:
                self.hooking = False
        return quiet

    def pre_hook(self, name: str):
        def hook(module, args, kwargs):
            self._settle_flops()
            t = self.traces[name]
            if not self.stack:
                self._flush_pending(t)
                self.consume((args, kwargs), name)
                self.homes.setdefault(name, []).extend(self._made_where((args, kwargs)))
                self.calls.append(name)
            if t.calls == 0:
                self.order.append(name)
                ins = _tensors((args, kwargs))
                t.in_shape = tuple(ins[0].shape) if ins else None
                t.in_bytes = sum(_nbytes(x) for x in ins)
                t.input_keys = frozenset(_storage_key(x) for x in ins)
            t.calls += 1
            self.stack.append(name)
        return self._quiet(hook)

    def post_hook(self, name: str):
        def hook(module, args, kwargs, output):
            self._settle_flops()
            t = self.traces[name]
            if t.calls == 1 and t.out_shape is None:
                outs = _tensors(output)
                if outs:
                    t.out_shape, t.out_dtype = tuple(outs[0].shape), dtype_name(outs[0].dtype)
                t.out_bytes = sum(_nbytes(x) for x in outs)
                t.saves_output = any(_storage_key(x) in t.saved_keys for x in outs)
                t.inner_grad_bytes = _inner_grads(t.grad_ops, {_storage_key(x) for x in outs})
                t.out_kind, leaves = _structure(output)
                t.out_leaves = tuple(None if x is None else (tuple(x.shape), dtype_name(x.dtype), x.requires_grad)
                                     for x in leaves)
            self.stack.pop()
            if not self.stack and t.out_kind != "other":  # each output leaf derives from itself
                for i, x in enumerate(_structure(output)[1]):
                    if x is not None:
                        self.sources[id(x)] = frozenset({(name, i)})
                        self.made_by[id(x)] = name
                        self.made.pop(id(x), None)
                        self.keep.append(x)
        return self._quiet(hook)

    def input_homes(self) -> dict[str, tuple]:
        """Layer -> the layers (or `input`) whose stage holds each of its tensor inputs when the
        model is cut at layer boundaries: a layer's output its own, glue its next layer's."""
        def home(h):
            return self.calls[h] if isinstance(h, int) and h < len(self.calls) else h if isinstance(h, str) else None
        for n, reads in self.glue_reads.items():  # glue runs in the stage of the layer called next
            if n < len(self.calls):
                self.homes[self.calls[n]].extend(reads)
        return {name: tuple(dict.fromkeys(x for x in map(home, hs) if x is not None)) for name, hs in self.homes.items()}

    def finish(self):
        self._settle_flops()
        if self.order:
            self._flush_pending(self.traces[self.order[-1]])

    # -- saved tensors: each storage once, for the layer that first saves it
    def pack(self, t: torch.Tensor):
        if not self.in_sdpa:
            self._count_saved([t])
        return t

    def _count_saved(self, tensors):
        for t in tensors:
            key = _storage_key(t)
            if self.stack:
                top = self.traces[self.stack[-1]]
                top.saves_input |= key in top.input_keys
                top.saved_keys.add(key)
            if key not in self.seen_storages:
                self.seen_storages.add(key)
                self.keep.append(t)  # a freed storage's address could come back as another's key
                try:
                    size = t.untyped_storage().nbytes()
                except Exception:
                    size = _nbytes(t)
                self._target().saved_bytes += size

    # -- root parameters and attention
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.root_params:
            for t in tree_leaves((args, kwargs)):
                name = self.root_params.get(id(t)) if isinstance(t, torch.Tensor) else None
                if name and name not in self.root_consumers:
                    if self.stack:
                        self.root_consumers[name] = self.stack[-1]
                    elif name not in self.pending_roots:
                        self.pending_roots.append(name)
        if func is torch.nn.functional.scaled_dot_product_attention:
            return self._noting_grads(lambda: self._sdpa(func, args, kwargs), args, kwargs)
        if func in _READ_VALUE and args and any(args[0] is t for t in self.alls):
            # `if padding_mask.all():` (HF's test to skip a mask nobody pads) read on meta data: there is no
            # data, so the general case, False: the mask is made (the run takes the path its data says).
            # Any other value read stays an error (M006): a branch on data cannot be traced
            return False
        if func in _GROUPED_MM and args and args[0].device.type == "meta" and args[0].dtype != torch.bfloat16:
            func = _as_matmul  # torch's meta kernel takes bf16 only
        out = self._noting_grads(lambda: func(*args, **kwargs), args, kwargs)
        if func in _ALL and isinstance(out, torch.Tensor) and out.device.type == "meta" and out.numel() == 1:
            self.alls.append(out)
        if not self.hooking and _tensors(out):  # a value read (not .dtype or .shape)
            self._read_outside(args, kwargs)
        if not self.stack and not self.hooking:  # glue: what it makes derives from what it reads
            srcs = self._sources((args, kwargs))
            if _tensors(out):  # a shape read (x.size(1)) carries no data
                self.glue_reads.setdefault(len(self.calls), []).extend(self._made_where((args, kwargs)))
            for t in _tensors(out):
                if srcs:
                    self.sources[id(t)] = srcs | self.sources.get(id(t), frozenset())
                self.made[id(t)] = len(self.calls)  # made before the next layer call
                self.keep.append(t)
        return out

    def _noting_grads(self, run, args, kwargs):
        """run(), an op of a layer's first call: note the gradients its backward holds (grad_ops)."""
        t = self.traces[self.stack[-1]] if self.stack else None
        before = t.saved_bytes if t else 0
        out = run()
        if t is None or t.calls != 1 or not torch.is_grad_enabled():
            return out
        ins = [x for x in _tensors((args, kwargs)) if x.requires_grad and _storage_key(x) not in self.param_storages]
        keys = {_storage_key(x) for x in ins}
        new = [x for x in _tensors(out) if x.requires_grad and _storage_key(x) not in keys]  # a view's: a view
        if new:
            t.grad_ops.append((sum(map(_nbytes, new + ins)), t.saved_bytes - before, {_storage_key(x) for x in new}))
        return out

    def _read_outside(self, args, kwargs):
        """Note a layer's parameter or buffer read by work outside that layer's forward."""
        for t in tree_leaves((args, kwargs)):
            owners, name = self.layer_tensors.get(id(t), (None, None)) if isinstance(t, torch.Tensor) else (None, None)
            if owners and not (self.stack and self.stack[-1] in owners):
                for owner in owners:
                    trace = self.traces[owner]
                    trace.read_outside = trace.read_outside or (name, self.stack[-1] if self.stack else None)

    def _sdpa(self, func, args, kwargs):
        # Meta runs the math kernel, which saves the T x T attention matrix; the
        # fused kernels used on devices save q, k, v, the output and a logsumexp.
        self.in_sdpa += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.in_sdpa -= 1
        if out.dim() == 4:  # the fused kernels' output is (batch, seq, heads, dim) in memory: the usual
            out = out.transpose(1, 2).contiguous().transpose(1, 2)  # transpose(1, 2) after it copies nothing
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v) if isinstance(x, torch.Tensor)):
            lse = out.new_empty(out.shape[:-1], dtype=torch.float32)
            self._count_saved([x for x in (q, k, v, out, lse) if isinstance(x, torch.Tensor)])
        return out


def trace_module(module: torch.nn.Module, layers: list[str], args: tuple, use_fx: bool = True) -> TraceResult:
    """Run one meta forward of `module` on `args`, measuring each of `layers`.

    Raises ForwardFailed (with the failing layer, if any) when the forward raises.
    """
    named = _named(args)
    if named is not None:
        args, use_fx = tuple(named.values()), False
    mods = {name: module.get_submodule(name) for name in layers}
    in_layers = {id(p) for m in mods.values() for p in list(m.parameters()) + list(m.buffers())}
    root_params = {id(p): n for n, p in list(module.named_parameters()) + list(module.named_buffers())
                   if id(p) not in in_layers}
    skip = {_storage_key(p) for p in list(module.parameters()) + list(module.buffers())}
    roots = [(p, n) for n, p in module.named_parameters() if id(p) not in in_layers]
    gm = fx_graph(module, layers) if use_fx else None
    if gm is not None:
        rec = _Recorder(mods, root_params, skip, roots)
        try:
            output = _run(rec, mods, lambda: _ShapeProp(gm).propagate(*args), args)
        except Exception:  # ShapeProp can fail where the module itself runs: try that
            gm = None
    if gm is None:
        rec = _Recorder(mods, root_params, skip, roots)
        try:
            output = _run(rec, mods, lambda: module(**named) if named is not None else module(*args), args)
        except Exception as e:
            raise ForwardFailed(e, rec.stack[-1] if rec.stack else None) from None
    return TraceResult(order=rec.order, layers=rec.traces, output=output,
                       traced_with="fx" if gm is not None else "hooks",
                       inputs=layer_inputs(gm, set(layers)) if gm is not None else {},
                       root_consumers=rec.root_consumers, root_users=rec.root_users, homes=rec.input_homes(),
                       glue_before=frozenset(rec.calls[n] for n in rec.glue_reads if n < len(rec.calls)),
                       calls=tuple(rec.calls), linear_reads={k: tuple(v) for k, v in rec.linear_reads.calls.items()})


def _inner_grads(ops: list, out_keys: set) -> int:
    """LayerInfo.inner_grad_bytes from a layer's grad_ops: backward runs its ops last first, each
    freeing what it saved; the op that makes the layer's output is the layer's own pair."""
    freed = most = 0
    for grads, saved, keys in reversed(ops):
        if not keys & out_keys:
            most = max(most, grads - freed)
        freed += saved
    return most


def _named(args: tuple) -> dict | None:
    """model.inputs: the one argument is {name: tensor}, passed to forward by keyword."""
    return args[0] if len(args) == 1 and isinstance(args[0], dict) else None


_READ_VALUE = (torch.Tensor.item, torch.Tensor.__bool__)
_ALL = (torch.all, torch.Tensor.all)
_GROUPED_MM = tuple(f for f in (getattr(torch, "_grouped_mm", None), getattr(torch.nn.functional, "grouped_mm", None))
                    if f is not None)


def _as_matmul(a, b, offs=None, bias=None, out_dtype=None):
    """A mixture of experts' grouped matmul on the meta device, as one matmul of its shape: torch's
    meta kernel checks CUDA's dtype rule (bf16 only), while the CPU kernel computes in float32.
    Tokens (S, in) sorted by expert times experts' weights (E, in, out) make (S, out): each token
    meets one expert's weight, the FLOPs and saved input of `a @ b[0]`."""
    out = a @ b[0] if a.dim() == 2 and b.dim() == 3 else torch.bmm(a, b) if a.dim() == 3 else a @ b
    out = out if bias is None else out + bias[0]
    return out if out_dtype is None else out.to(out_dtype)


# autograd nodes that act on each feature alone (an MLP's activation, a gate's product, dropout)
_ELEMENTWISE = ("Gelu", "Relu", "Silu", "Tanh", "Sigmoid", "Mul", "Dropout", "Clone", "Hardswish", "Elu")


class _LinearReads:
    """Each Linear's first call inside a layer: which tensor it reads (numbered, kept alive so that
    ids stay distinct) and the Linear of the same layer whose output it reads through elementwise
    work only, if any (BERT's intermediate.dense -> GELU -> output.dense)."""

    def __init__(self, mods: dict):
        self.calls: dict[str, list] = {name: [] for name in mods}
        self.called: set = set()  # (layer, path) of each Linear called so far
        self.keys: dict[int, int] = {}  # id(an input read) -> its number
        self.seen: list = []  # every input read, alive until the trace ends (so ids stay distinct)
        self.made: dict[int, tuple[str, str]] = {}  # id(grad_fn of a Linear's output) -> (layer, path)
        self.linears = [(layer, path, m) for layer, lm in mods.items() for path, m in lm.named_modules()
                        if path and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")]

    def hooks(self):
        for layer, path, m in self.linears:
            yield m.register_forward_pre_hook(self._pre(layer, path))
            yield m.register_forward_hook(self._post(layer, path))

    def _pre(self, layer, path):
        def hook(module, args):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is None or (layer, path) in self.called:  # its first call only
                return
            self.called.add((layer, path))
            key = self.keys.setdefault(id(x), len(self.seen))
            if key == len(self.seen):
                self.seen.append(x)
            self.calls[layer].append((path, key, self._feeder(layer, x.grad_fn), math.prod(x.shape[:-1]),
                                      x.requires_grad))
        return hook

    def _post(self, layer, path):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor) and out.grad_fn is not None:
                self.made[id(out.grad_fn)] = (layer, path)
        return hook

    def _feeder(self, layer, fn) -> str:
        """The Linear of `layer` whose output reaches here through elementwise nodes only, else ''."""
        for _ in range(16):
            if fn is None:
                return ""
            made = self.made.get(id(fn))
            if made is not None:
                return made[1] if made[0] == layer else ""
            if not any(w in type(fn).__name__ for w in _ELEMENTWISE):
                return ""
            fn = next((f for f, _ in fn.next_functions if f is not None and type(f).__name__ != "AccumulateGrad"), None)
        return ""


def _run(rec: _Recorder, mods: dict, forward, inputs=()):
    rec.input_ids = {id(x) for x in _tensors(inputs)}
    handles = list(rec.linear_reads.hooks())
    for name, m in mods.items():
        handles.append(m.register_forward_pre_hook(rec.pre_hook(name), with_kwargs=True))
        handles.append(m.register_forward_hook(rec.post_hook(name), with_kwargs=True))
    try:
        with torch.enable_grad(), rec.flops, rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            output = forward()
        rec.finish()
        rec.consume(output, OUTPUT)
        return output
    finally:
        for h in handles:
            h.remove()


def autocast_dtypes(module: torch.nn.Module, layers: list[str], args: tuple) -> dict[str, tuple]:
    """Each layer's output leaf dtypes (names, None for a None leaf) as `precision: bf16` runs it:
    autocast does not act on meta tensors, so the forward runs again on fake CPU tensors (no
    memory spent) under CPU autocast, the module's parameters and buffers swapped for fake ones
    for the call. What a lockstep program sends across a boundary leaves in these dtypes, as one
    device holds it there. {} when that forward raises (the crossings then keep the meta trace's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    found: dict[str, tuple] = {}

    def hook(name):
        def record(module, args, output):
            found.setdefault(name, tuple(None if x is None else dtype_name(x.dtype) for x in _structure(output)[1]))
        return record

    handles = [module.get_submodule(n).register_forward_hook(hook(n)) for n in layers]
    try:
        with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):
            state = {n: torch.empty(t.shape, dtype=t.dtype, requires_grad=t.requires_grad) for n, t in
                     list(module.named_parameters()) + list(module.named_buffers())}  # tied: one name each
            named = _named(args) or {}
            fake = tuple(torch.empty(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x for x in args)
            functional_call(module, state, () if named else fake,
                            {k: torch.empty(x.shape, dtype=x.dtype) for k, x in named.items()}, strict=False)
    except Exception:  # a model fake tensors cannot run: lockstep casts to the traced dtypes, as before
        return {}
    finally:
        for h in handles:
            h.remove()
    return found
