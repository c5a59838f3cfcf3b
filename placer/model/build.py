"""Build the model a spec describes, on the meta device, and measure its layers.

`build_module` makes the `nn.Module` (inline `torch.nn` layers, or the user's
class imported from `model.module`); `build_graph` traces it once on meta
tensors into a `ModelGraph`; `deep_check` is what `placer validate --deep`
adds to the plain checks. Building on meta spends no weight memory, so a
billion-parameter model builds and traces in seconds.

Any user-caused failure (missing file, import error, constructor or forward
raising, output the loss cannot take) becomes a SpecError with an M-code
located in the spec; the message carries the exception's last line and the
line of the user's file where it was raised, never a traceback.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
import warnings
from collections.abc import Mapping
from typing import cast

import torch
from torch import nn

from placer.diagnostics import Diagnostic, Loc, SpecError, name_hint
from placer.model.deferred import defer_compile_imports
from placer.model.graph import OUTPUT, LayerInfo, ModelGraph, RootParam, Tie
from placer.model.trace import INPUT, ForwardFailed, autocast_dtypes, dtype_name, trace_module
from placer.modes import MODES
from placer.modes.tensor import HEAD_ATTRS
from placer.plan import crossings, ties
from placer.plan.ir import PlacedSegment
from placer.spec import check
from placer.spec.types import Layer, Spec

# -- building ---------------------------------------------------------------------------------------

class InlineModel(nn.Module):
    """Inline layers run in order; `repeat` layers live in a ModuleList (`block.0` ..)."""

    def __init__(self, layers: list[tuple[str, nn.Module]]):
        super().__init__()
        for name, module in layers:
            base, _, index = name.partition(".")
            if index:
                if base not in self._modules:
                    self.add_module(base, nn.ModuleList())
                cast(nn.ModuleList, self._modules[base]).append(module)
            else:
                self.add_module(name, module)

    def forward(self, x):
        for child in self.children():
            for layer in (child if isinstance(child, nn.ModuleList) else (child,)):
                x = layer(x)
        return x


@defer_compile_imports()
def build_module(spec: Spec, device: str | torch.device = "meta") -> nn.Module:
    """The spec's model, its parameters created on `device` (meta by default)."""
    if spec.model.inline:
        return _build_inline(spec, device)
    cls = load_model_class(spec)
    assert spec.model.module is not None  # a module model
    name = spec.model.module.rpartition(":")[2]
    with _import_path(spec), torch.device(device):
        try:
            model = cls(**spec.model.kwargs)
        except Exception as e:
            raise SpecError(_diag("M004", f"{spec.model.module}: {name}(**kwargs) raised "
                                  f"{_describe(e, spec)}", _module_loc(spec),
                                  "check model.kwargs against the class's constructor")) from None
    if not isinstance(model, nn.Module):  # a factory function (SPEC.md allows one) that returned something else
        raise SpecError(_diag("M004", f"{spec.model.module}: {name}(**kwargs) returned a value of type "
                              f"{type(model).__name__}, not an nn.Module", _module_loc(spec),
                              "model.module names a class or a function that returns an nn.Module"))
    return model


def _build_inline(spec: Spec, device) -> nn.Module:
    layers, seen, probe = [], set(), nn.Module()
    assert spec.model.layers is not None  # an inline model
    for layer in spec.model.layers:
        if layer.name in seen:
            raise SpecError(_diag("M010", f"layer name {layer.name!r} is used twice", layer.loc,
                                  "give every layer a unique name"))
        seen.add(layer.name)
        base = layer.name.split(".")[0]
        if hasattr(probe, base):  # add_module refuses `forward`, `training`, ...
            raise SpecError(_diag("M010", f"layer name {base!r} is an attribute of torch.nn.Module", layer.loc,
                                  "rename the layer"))
        with torch.device(device):
            try:
                layers.append((layer.name, getattr(nn, layer.op)(*layer.args, **layer.kwargs)))
            except Exception as e:
                raise SpecError(_diag("M005", f"layer {layer.name!r}: {layer.op}(*args, **kwargs) raised "
                                      f"{_describe(e, spec)}", layer.loc,
                                      f"check the arguments against torch.nn.{layer.op}")) from None
    return InlineModel(layers)


def load_model_class(spec: Spec):
    """Import what `model.module` names (a file relative to the spec, or `pkg.mod`): an nn.Module
    class, or any other callable that returns an nn.Module (`torchvision.models:resnet18`, a
    `functools.partial`)."""
    assert spec.model.module is not None  # a module model
    target, _, cls_name = spec.model.module.rpartition(":")
    loc = _module_loc(spec)
    with _import_path(spec):
        if target.endswith(".py"):
            mod = _import_file(_model_file(spec), spec)
        else:
            try:
                mod = importlib.import_module(target)
            except ModuleNotFoundError as e:
                if e.name and (target == e.name or target.startswith(e.name + ".")):
                    raise SpecError(_diag("M001", f"model module {target!r} cannot be found", loc,
                                          "use path/to/file.py:Class (relative to the spec) or an importable "
                                          "package.module:Class")) from None
                raise SpecError(_diag("M002", f"importing {target!r} raised {_describe(e, spec)}", loc)) from None
            except Exception as e:
                raise SpecError(_diag("M002", f"importing {target!r} raised {_describe(e, spec)}", loc)) from None
    cls = getattr(mod, cls_name, None)
    if cls is None:
        names = [n for n, v in vars(mod).items() if isinstance(v, type) and issubclass(v, nn.Module)]
        raise SpecError(_diag("M003", f"{target} has no class {cls_name!r}", loc,
                              name_hint("its nn.Module classes", cls_name, names) if names else None))
    if isinstance(cls, type) and not issubclass(cls, nn.Module) or not callable(cls):
        raise SpecError(_diag("M003", f"{spec.model.module} is not an nn.Module subclass or a function "
                              f"({type(cls).__name__})", loc,
                              "name a class that derives from torch.nn.Module, or a function that returns one"))
    return cls


def _model_file(spec: Spec) -> str:
    assert spec.model.module is not None  # a module model
    rel = spec.model.module.rpartition(":")[0]
    return os.path.normpath(os.path.join(_spec_dir(spec), rel))


def _spec_dir(spec: Spec) -> str:
    return os.path.dirname(os.path.abspath(spec.file)) if spec.file not in ("<stdin>", "<spec>", "-") else os.getcwd()


def _import_file(path: str, spec: Spec):
    loc = _module_loc(spec)
    if not os.path.isfile(path):
        raise SpecError(_diag("M001", f"model file {path!r} does not exist", loc,
                              "model.module files are relative to the spec file"))
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    # A unique name per file, so two specs' `model.py` never share a module.
    name = f"placer_user_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    mspec = importlib.util.spec_from_file_location(name, path)
    assert mspec is not None and mspec.loader is not None  # a .py file has a source loader
    mod = importlib.util.module_from_spec(mspec)
    sys.modules[name] = mod  # dataclasses and pickling look the module up by name
    try:
        mspec.loader.exec_module(mod)
    except BaseException as e:
        sys.modules.pop(name, None)
        if not isinstance(e, Exception):  # KeyboardInterrupt and friends
            raise
        raise SpecError(_diag("M002", f"importing {os.path.relpath(path, _spec_dir(spec))} raised "
                              f"{_describe(e, spec)}", loc)) from None
    return mod


@contextlib.contextmanager
def _import_path(spec: Spec):
    """The model file's directory (or the spec's) on sys.path, for sibling imports."""
    d = os.path.dirname(_model_file(spec)) if spec.model.module and ".py:" in spec.model.module else _spec_dir(spec)
    added = d not in sys.path
    if added:
        sys.path.insert(0, d)
    try:
        yield
    finally:
        if added and d in sys.path:
            sys.path.remove(d)


# -- layers -----------------------------------------------------------------------------------------

def _is_container(m: nn.Module) -> bool:
    """ModuleList/ModuleDict, and Sequential whose forward is torch's: names only, no own work."""
    if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
        return True
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def placeable_layers(module: nn.Module, order: list[str] | None = None, selectors=()) -> list[str]:
    """Names a spec can place: top-level children, containers expanded recursively, and deeper
    where a selector names a path inside one (`gpt.transformer.h.0` expands `gpt`, then
    `gpt.transformer`, into their children: the spec chooses the depth).

    In definition order, or, given `order` (first-call order from a trace), in
    that order with layers never called last. ParameterList/Dict are not layers:
    their parameters are root parameters, as are an expanded parent's own.
    """
    names = _children(module, "")
    for text in selectors:
        for path in selector_paths(text):
            names = _expand_to(module, names, path)
    if order is None:
        return names
    known = set(names)
    ran = [n for n in order if n in known]
    return ran + [n for n in names if n not in set(ran)]


def _children(m: nn.Module, prefix: str) -> list[str]:
    names: list[str] = []
    for n, child in m.named_children():
        if isinstance(child, (nn.ParameterList, nn.ParameterDict)):
            continue
        names += _children(child, f"{prefix}{n}.") if _is_container(child) else [prefix + n]
    return names


def selector_paths(text: str) -> list[str]:
    """The module paths a selector names: a range's two ends, a name, or a glob's fixed dotted
    prefix with its dot (`encoder.*`: `encoder.`), which opens the layer it names."""
    from placer.spec import select
    if select.is_range(text):
        return [p for p in text.partition("..")[::2] if p]
    if select.is_glob(text):
        stem = re.split(r"[*?\[]", text, maxsplit=1)[0]
        return [stem[:stem.rfind(".") + 1]] if "." in stem else []
    return [text]


def _expand_to(module: nn.Module, names: list[str], path: str) -> list[str]:
    """`names` with the layer that holds `path` (strictly inside it) replaced by its children,
    again until `path` is a layer, a container's prefix, or no module's path."""
    while True:
        holder = next((n for n in names if path.startswith(n + ".")), None)
        if holder is None:
            return names
        kids = _children(module.get_submodule(holder), holder + ".")
        if not kids:  # a leaf module: `path` names nothing inside it (P001 says so)
            return names
        i = names.index(holder)
        names = names[:i] + kids + names[i + 1:]


def selector_texts(spec: Spec) -> list[str]:
    return [sel.text for seg in spec.placement for sel in seg.selectors]


# -- the graph --------------------------------------------------------------------------------------

def meta_batch(spec: Spec, batch: int | None = None, device="meta") -> tuple:
    """(input, target) zeros of the spec's shapes and dtypes on the global (or given) batch; the
    input a {name: tensor} of `model.inputs` where the spec names several."""
    b = spec.training.batch_size if batch is None else batch
    m = spec.model

    def zeros(t):
        return torch.zeros(t.concrete(b), dtype=getattr(torch, t.dtype), device=device)
    x = {k: zeros(t) for k, t in m.inputs} if m.inputs else zeros(m.input)
    return x, zeros(m.target)


@defer_compile_imports()
def build_graph(spec: Spec, module: nn.Module | None = None) -> ModelGraph:
    """Trace the spec's model (built on meta unless given) into a ModelGraph on the global batch."""
    module = build_module(spec) if module is None else module
    layers = placeable_layers(module, selectors=selector_texts(spec))
    if not layers:
        raise SpecError(_diag("M009", f"model {type(module).__name__} has no child modules to place", _module_loc(spec),
                              "layers are the model's child modules (ModuleList/Sequential/ModuleDict are "
                              "expanded); wrap the work in submodules"))
    x, _ = meta_batch(spec)
    try:
        with warnings.catch_warnings():  # meta-only artefacts; the real run shows real warnings
            warnings.simplefilter("ignore")
            tr = trace_module(module, layers, (x,), use_fx=not spec.model.inline)
    except ForwardFailed as e:
        raise SpecError(_forward_diag(spec, module, e)) from None
    names = placeable_layers(module, tr.order, selector_texts(spec))
    as_run = {}  # bf16: what lockstep sends leaves in autocast's dtypes (inline segments cast back to float32)
    if spec.training.precision == "bf16" and not spec.model.inline:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            as_run = autocast_dtypes(module, names, (x,))
    counted: set[int] = set()
    order = {n: i for i, n in enumerate(names + [OUTPUT])}
    infos = []
    for i, name in enumerate(names):
        t, m = tr.layers[name], module.get_submodule(name)
        own = [p for p in m.parameters() if id(p) not in counted]
        shared = sum(p.numel() for p in m.parameters() if id(p) in counted)
        buffers = [b for b in m.buffers() if id(b) not in counted]
        counted |= {id(p) for p in own + buffers}
        trainable = [p for p in own if p.requires_grad]
        frozen = [p for p in own if not p.requires_grad]
        inputs: tuple[str, ...] | None
        if spec.model.inline:
            inputs = (names[i - 1],) if i else (INPUT,)
        else:
            inputs = tr.inputs.get(name) if tr.traced_with == "fx" else None
        infos.append(LayerInfo(
            name=name, op=type(m).__name__,
            params=sum(p.numel() for p in trainable), param_bytes=sum(_bytes(p) for p in trainable),
            buffer_bytes=sum(_bytes(b) for b in buffers + frozen),
            in_shape=t.in_shape, out_shape=t.out_shape, out_dtype=t.out_dtype, out_bytes=t.out_bytes,
            in_bytes=t.in_bytes, saved_bytes=t.saved_bytes, saves_input=t.saves_input,
            saves_output=t.saves_output, inner_grad_bytes=t.inner_grad_bytes, flops=t.flops,
            shared_params=shared, inputs=inputs, out_kind=t.out_kind, calls=max(1, t.calls), homes=tr.homes.get(name, ()),
            out_leaves=_leaves_as_run(t.out_leaves, as_run.get(name)),
            consumers=tuple((i, tuple(sorted(c, key=order.__getitem__))) for i, c in sorted(t.consumers.items())),
            glue_before=name in tr.glue_before, read_outside=t.read_outside, **({} if spec.model.inline else _projections(m)),
            window=() if spec.model.inline else _window(m), linear_reads=tr.linear_reads.get(name, ()),
            experts=() if spec.model.inline else _experts(m),
            expert_weights=() if spec.model.inline else _expert_weights(m),
            param_rows=tuple((p.shape[0] if p.dim() else 1, _bytes(p) // max(p.shape[0] if p.dim() else 1, 1))
                             for p in trainable),
            norms=() if spec.model.inline else tuple(x.num_features for x in m.modules() if isinstance(
                x, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))),
        ))
    roots = tuple(
        RootParam(name=n, numel=p.numel(), bytes=_bytes(p), trainable=isinstance(p, nn.Parameter) and p.requires_grad,
                  consumer=tr.root_consumers.get(n), users=tuple(sorted(tr.root_users.get(n, ()), key=order.__getitem__)))
        for n, p in list(module.named_parameters()) + list(module.named_buffers()) if id(p) not in counted)
    out = model_output(spec, tr.output)
    if not isinstance(out, torch.Tensor):
        _output_diag(spec, tr.output)
        out = None
    first = next(iter(x.values())) if isinstance(x, dict) else x  # model.inputs: the first's rows are the batch's
    return ModelGraph(
        layers=tuple(infos), batch_size=spec.training.batch_size, input_shape=tuple(first.shape),
        input_dtype=dtype_name(first.dtype), traced_with="inline" if spec.model.inline else tr.traced_with,
        output_shape=tuple(out.shape) if out is not None else None,
        output_dtype=dtype_name(out.dtype) if out is not None else None, root_params=roots,
        ties=find_ties(module, names), loss=spec.model.loss,
    )


def _window(m: nn.Module) -> tuple:
    """LayerInfo's `window` of a module model's Conv / Pool layer (() for others and for string
    padding, 'same': no static halo)."""
    pools = (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)
    if not isinstance(m, (nn.modules.conv._ConvNd, *pools)) or isinstance(m.padding, str):
        return ()
    n = int(type(m).__name__[-2])  # Conv2d, MaxPool1d, AvgPool3d

    def per_dim(v) -> tuple:
        return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n
    return tuple(per_dim(v) for v in (m.kernel_size, m.stride, m.padding, getattr(m, "dilation", 1)))


_TOP_K = ("top_k", "num_experts_per_tok", "k")


def _experts(layer: nn.Module) -> tuple:
    """(path, experts, top k) of each mixture of experts in a layer: a module holding `num_experts`
    and a parameter with that many rows (HF's stacked experts), or an nn.ModuleList named
    `experts`; its top k from its parent, the parent's router or the config (0: not found)."""
    out = []
    for path, m in layer.named_modules():
        n = getattr(m, "num_experts", None)
        stacked = isinstance(n, int) and any(p.dim() == 3 and p.shape[0] == n for p in m.parameters(recurse=False))
        if not stacked and not (isinstance(m, nn.ModuleList) and path.rpartition(".")[2] == "experts"):
            continue
        parent = layer.get_submodule(path.rpartition(".")[0]) if "." in path else layer
        near = [parent, *parent.children(), getattr(parent, "config", None), getattr(m, "config", None)]
        k = next((v for x in near if x is not None for a in _TOP_K
                  if isinstance(v := getattr(x, a, None), int) and not isinstance(v, bool)), 0)
        out.append((path, n if stacked else len(m), k))
    return tuple(out)


def _expert_weights(layer: nn.Module) -> tuple:
    """LayerInfo's `expert_weights`, one entry per mixture of experts of `_experts`: what expert
    parallelism cuts and sends (modes/expert.py)."""
    out = []
    for path, e, _ in _experts(layer):
        m = layer.get_submodule(path)
        # Hugging Face's experts: 3-D weights, called as experts(hidden, top_k_index, top_k_weights)
        stacked = not isinstance(m, nn.ModuleList) and len(inspect.signature(m.forward).parameters) == 3
        cut = [p for p in m.parameters(recurse=isinstance(m, nn.ModuleList))
               if p.requires_grad and (isinstance(m, nn.ModuleList) or p.shape[0] == e)]
        parent = layer.get_submodule(path.rpartition(".")[0]) if "." in path else layer
        noise = getattr(parent, "jitter_noise", 0) or getattr(getattr(parent, "config", None), "router_jitter_noise", 0)
        out.append((path, getattr(m, "hidden_dim", 0), sum(p.numel() for p in cut), stacked, float(noise or 0)))
    return tuple(out)


def _projections(layer: nn.Module) -> dict:
    """LayerInfo's `projections` and `heads` of a module model's layer (tensor's inputs)."""
    proj, heads, tables = [], [], []
    for path, m in layer.named_modules():
        if isinstance(m, nn.Embedding) and path:  # a value per head and position (runtime/tensor.py head_tables)
            tables.append((path, m.embedding_dim, m.weight.numel()))
        if path and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"):
            # transformers' Conv1D keeps its weight as [in, out] (nx, nf)
            n_in, n_out = (m.in_features, m.out_features) if isinstance(m, nn.Linear) else (m.nx, m.nf)
            proj.append((path, type(m).__name__, n_in, n_out, m.bias is not None))
        for holder, prefix in ((m, ""), (getattr(m, "config", None), "config.")):
            for attr in HEAD_ATTRS:
                value = getattr(holder, attr, None) if holder is not None else None
                if isinstance(value, int) and not isinstance(value, bool):
                    heads.append((path, prefix + attr, value))
    counts: dict[str, set[int]] = {}  # module path -> the head counts it holds
    for path, _, v in heads:
        counts.setdefault(path, set()).add(v)
    per_head = tuple((path, name, tuple(t.shape)) for path, n in counts.items()  # ALiBi's slopes, a bias [heads, ..]
                     for name, t in [*layer.get_submodule(path).named_parameters(recurse=False),
                                     *layer.get_submodule(path).named_buffers(recurse=False)] if set(t.shape) & n)
    return {"projections": tuple(proj), "heads": tuple(heads), "head_tensors": per_head,
            "head_tables": tuple((p, n) for p, dim, n in tables if dim in counts.get(p.rpartition(".")[0], ()))}


def model_output(spec: Spec, output):
    """What the loss takes: the forward's output, or its `model.output` field (a mapping's key, a
    `ModelOutput`'s field, an attribute); None when there is no such field."""
    name = spec.model.output
    if name is None:
        return output
    if isinstance(output, Mapping):  # a Hugging Face ModelOutput is an OrderedDict
        return output.get(name)
    return getattr(output, name, None)


def _fields(output) -> list[str]:
    """The tensor fields of a forward's output that `model.output` could name."""
    if isinstance(output, Mapping):
        items = list(output.items())
    elif hasattr(output, "_fields"):  # a namedtuple
        items = [(f, getattr(output, f)) for f in output._fields]
    else:
        items = list(getattr(output, "__dict__", {}).items())
    return [str(k) for k, v in items if isinstance(v, torch.Tensor)]


def _output_diag(spec: Spec, output) -> None:
    """M011 when `model.output` names no tensor field; M008 (with the fields) for a mapping or an
    object with tensor fields but no `model.output`. A plain non-tensor output is M008 in deep_check."""
    fields, kind = _fields(output), type(output).__name__
    loc = spec.doc.loc(("model", "output")) if spec.model.output else _module_loc(spec)
    listed = ", ".join(fields) if fields else "none"
    if spec.model.own_loss:  # HF computes it only given labels
        raise SpecError(_diag("M011", f"model.output is loss, and the forward's {kind} holds no loss (its tensor "
                              f"fields: {listed})", loc, "give forward what makes it compute its loss: HF models "
                              "take `labels` (add it to model.inputs); or name the field a `loss:` takes"))
    if spec.model.output:
        raise SpecError(_diag("M011", f"the model's forward returns {kind}, which has no tensor field "
                              f"{spec.model.output!r} (its tensor fields: {listed})", loc,
                              name_hint("fields", spec.model.output, fields) if fields else
                              "forward returns a tensor: remove model.output" if isinstance(output, torch.Tensor)
                              else "model.output names a key or field of what forward returns"))
    if fields:
        raise SpecError(_diag("M008", f"the model's forward returns {kind}, not a tensor (its tensor fields: "
                              f"{listed})", loc, f"set model.output to the field the loss takes "
                              f"(output: {fields[0]})"))


def find_ties(module: nn.Module, layers: list[str]) -> tuple[Tie, ...]:
    """Trainable parameters that two or more of `layers` (in execution order) use."""
    users: dict[int, dict[str, list[str]]] = {}  # id -> {layer: the parameter's names under it}
    params = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        layer = next((l for l in layers if name.startswith(l + ".")), None)
        if layer is not None and p.requires_grad:
            users.setdefault(id(p), {}).setdefault(layer, []).append(name)
            params[id(p)] = p
    first = {id(p): n for n, p in module.named_parameters()}  # the name it is saved under
    ties = []
    for key, by_layer in users.items():
        if len(by_layer) > 1:
            order = sorted(by_layer, key=layers.index)
            ties.append(Tie(name=first[key], names=tuple(by_layer[l][0] for l in order), layers=tuple(order),
                            aliases=tuple(tuple(by_layer[l]) for l in order),
                            numel=params[key].numel(), bytes=_bytes(params[key]),
                            rows=params[key].shape[0] if params[key].dim() else 1))
    return tuple(sorted(ties, key=lambda t: layers.index(t.layers[0])))


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def segment_layers(spec: Spec, graph: ModelGraph) -> list[list[str]]:
    """Layer names per segment, in model order; SpecError if selectors do not resolve."""
    groups, diags = check.resolve_segments(spec, graph.names)
    if diags:
        raise SpecError(diags)
    return [[graph.names[i] for i in idx] for idx in groups]


def loss_inputs(spec: Spec, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the loss is applied to. Inline models: (output, target) as they are.

    Module models (SPEC.md: "output flattened, target flattened"), leading dims
    merged into one: integer (class) targets with one dim less than the output
    give `[N, C]` and `[N]`; targets with as many dims give `[N, last]` both;
    otherwise, with equal sizes, both are flattened to 1-D (`[B, 1]` vs `[B]`).
    Anything else is passed as it is (and the loss reports the mismatch).
    """
    if spec.model.inline or output.dim() < 2:
        return output, target
    if target.dim() == output.dim() - 1 and not target.is_floating_point():
        return output.reshape(-1, output.shape[-1]), target.reshape(-1)
    if target.dim() == output.dim():
        return output.reshape(-1, output.shape[-1]), target.reshape(-1, target.shape[-1])
    if target.numel() == output.numel():
        return output.reshape(-1), target.reshape(-1)
    return output, target


# -- validate --deep --------------------------------------------------------------------------------

@defer_compile_imports()
def deep_check(spec: Spec) -> list[Diagnostic]:
    """`validate --deep`: build and trace on meta, then the checks that need real layer names."""
    try:
        module = build_module(spec)
        graph = build_graph(spec, module)
    except SpecError as e:
        return e.diagnostics
    return _deep_diagnostics(spec, module, graph)


@defer_compile_imports()
def checked_graph(spec: Spec) -> ModelGraph:
    """The spec's ModelGraph once `validate --deep`'s checks pass: plan, generate and run refuse
    every spec that `validate --deep` refuses (SpecError with its errors), before planning."""
    module = build_module(spec)
    graph = build_graph(spec, module)
    errors = [d for d in _deep_diagnostics(spec, module, graph) if d.severity == "error"]
    if errors:
        raise SpecError(errors)
    return graph


def _deep_diagnostics(spec: Spec, module: nn.Module, graph: ModelGraph) -> list[Diagnostic]:
    diags = _check_loss(spec, graph)
    if not spec.model.inline and not spec.auto:  # (auto: the search checks what it places)
        groups, sel = check.resolve_segments(spec, graph.names)
        diags += sel
        if not sel:
            diags += _check_module_modes(spec, module, graph, groups)
            diags += ties.check(spec, graph, groups)
            placed = [PlacedSegment(index=k, name=s.name, layers=tuple(graph.names[i] for i in idx),
                                    devices=s.devices, mode=s.mode) for k, (s, idx) in enumerate(zip(spec.placement, groups))]
            diags += crossings.check(spec, graph, placed)
            if not any(d.severity == "error" for d in diags) and crossings.lockstep(spec, placed):
                diags += _check_batch_dims(spec, module, graph, placed) + _check_stage_order(spec, module, graph, placed)
                diags += _check_outside_reads(spec, graph, placed)
            elif not any(d.severity == "error" for d in diags) and len(placed) > 1:
                diags += _check_cut(spec, module, placed)
    if not spec.model.inline:
        dropout = next((n for n, m in module.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd)
                        and m.p > 0), None)
        if dropout and len(spec.devices) > 1:
            diags.append(_diag("W003", f"module {dropout!r} is a Dropout (p={module.get_submodule(dropout).p}): random "
                               "masks differ from a one-device run, so run --check cannot match", _module_loc(spec),
                               "set its p to 0 to check equivalence, or accept a mismatch in --check",
                               severity="warning"))
    return sorted(diags, key=lambda d: (d.severity != "error", d.loc.line, d.loc.col))


def _check_batch_dims(spec: Spec, module: nn.Module, graph: ModelGraph, placed) -> list[Diagnostic]:
    """P088: lockstep's stand-ins (and the plan's micro-batch copies) take a placed layer's output
    leaf whose traced dim 0 is the batch size to have the batch there, and cut only that dim when
    a forward sees fewer rows (micro-batches, accumulate's micro-steps, replica pipelines). Traced
    again on those rows, every leaf must have the shape that rule gives it, or the ranks would
    exchange tensors of other shapes."""
    b = spec.training.batch_size
    cut = (spec.pipeline.microbatches if spec.pipeline else 1) * spec.training.accumulate
    rows = b // cut // len(crossings.pipelines(placed))
    if rows == b or b % cut:
        return []
    x, _ = meta_batch(spec, rows)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = trace_module(module, list(graph.names), (x,), use_fx=False)
    except ForwardFailed as e:
        return [_diag("P088", f"the model does not run on {rows} rows, what one forward of each rank sees in lockstep "
                      f"({type(e.__cause__ or e).__name__})", _module_loc(spec), "use a batch whose cut runs")]
    for seg in placed:
        for name in seg.layers:
            now = tr.layers[name].out_leaves if name in tr.layers else ()
            for i, (whole, got) in enumerate(zip(graph.layer(name).out_leaves, now)):
                if whole is None or got is None:
                    continue
                want = (rows, *whole[0][1:]) if whole[0] and whole[0][0] == b else tuple(whole[0])
                if tuple(got[0]) != want:
                    return [_diag("P088", f"output {i} of layer {name!r} is {list(whole[0])} on the batch of {b} "
                                  f"and {list(got[0])} on {rows} rows, not {list(want)}: lockstep takes dim 0 for the "
                                  "batch where it equals the batch size, and no other dim", spec.placement[seg.index].loc,
                                  "use a batch size that no other dim of what crosses equals, keep the batch in dim 0 "
                                  "(batch_first), or do without micro-batches and replica pipelines")]
    return []


def _check_stage_order(spec: Spec, module: nn.Module, graph: ModelGraph, placed) -> list[Diagnostic]:
    """P089: where a rank holds several stages, lockstep runs each micro-batch's forward in a
    thread that stops before the work of the rank's next stage until the schedule's action lets
    it go on, and receives what crosses in the action of its first stage after the producer's: that
    takes the layers to be called in segment order. Their first calls are (segments follow model
    order); a layer called again after a later segment's layers is refused."""
    if not spec.pipeline or len({s.devices for s in placed}) == len(placed):
        return []
    if all(graph.layer(name).calls == 1 for s in placed for name in s.layers):
        return []
    x, _ = meta_batch(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = trace_module(module, list(graph.names), (x,), use_fx=False)
    seg_of = {name: s.index for s in placed for name in s.layers}
    top = 0
    for name in tr.calls:
        k = seg_of.get(name, top)
        if k < top:
            return [_diag("P089", f"layer {name!r} of segment {placed[k].name!r} is called again after the layers of "
                          f"segment {placed[top].name!r}: where a rank holds several stages ({spec.pipeline.schedule}), "
                          "lockstep runs each stage's work in the schedule's action for it, in segment order",
                          spec.placement[k].loc, "place the layers its later calls sit between in its segment, or "
                          "use a schedule with one stage per device (gpipe, 1f1b)")]
        top = k
    return []


def _check_cut(spec: Spec, module: nn.Module, placed) -> list[Diagnostic]:
    """P099: a module model that does not run in lockstep is cut by torch.distributed.pipelining
    in the program (runtime/cut.py cut_pipe, on the meta model); the same cut is made here, so a
    model torch.export cannot trace (data-dependent control flow, an op it does not take) or a
    stage tensor that has no seed value (what materialize_cut refuses) is named before any worker
    starts."""
    from placer.codegen.runtime.cut import cut_pipe
    from placer.codegen.runtime.seed import unseeded

    if spec.model.inputs:  # the cut passes one tensor into the first stage
        return [_diag("P095", f"model.inputs names {len(spec.model.inputs)} inputs, and this placement is cut by "
                      "torch.distributed.pipelining, which feeds its first stage one tensor (it does not run in "
                      "lockstep: see P083)", spec.doc.loc(("model", "inputs")),
                      "place the model one device per segment, or data parallel over groups of one size: lockstep "
                      "runs the model's own forward with every input, under any schedule")]

    where = ", ".join(f"before {s.layers[0]!r} (segment {s.name!r})" for s in placed[1:])
    hint = ("place the module model one device per segment, or data parallel over groups of one size (a server on "
            "a device of the placement): lockstep runs the model's own code uncut; or cut elsewhere")
    x, _ = meta_batch(spec)
    hook = module.register_forward_hook(lambda m, a, out: model_output(spec, out)) if spec.model.output else None
    try:
        with warnings.catch_warnings(), _import_path(spec):
            warnings.simplefilter("ignore")
            pipe = cut_pipe(module, x, [s.layers[0] for s in placed[1:]])
    except Exception as e:
        seg, layer, inner = _raising_layer(e, module, placed)
        cause: BaseException = e
        while cause.__cause__ is not None:  # pipelining wraps export's error in a generic one
            cause = cause.__cause__
        reason = (str(cause).strip().splitlines() or [""])[0].split(". ")[0]  # torch's first sentence
        what = (f"layer {layer!r}{f' (its submodule {inner!r})' if inner != layer else ''} of segment {seg.name!r}"
                if seg else "the model's own forward (no placed layer)")
        return [_diag("P099", f"torch.distributed.pipelining cannot cut the module model {where} (segments of "
                      f"different sizes do not run in lockstep): its trace (torch.export) fails in {what}: "
                      f"{type(cause).__name__}: {reason}", spec.placement[seg.index if seg else 0].loc, hint)]
    finally:
        if hook is not None:
            hook.remove()
    names = {n for n, _ in [*module.named_parameters(remove_duplicate=False),
                            *module.named_buffers(remove_duplicate=False)]}
    for s in placed:
        missing = unseeded(pipe.get_stage_module(s.index), names)
        if missing:
            return [_diag("P099", f"torch.distributed.pipelining's stage for segment {s.name!r} holds tensor "
                          f"{missing[0]!r}, which is neither a parameter or buffer of the model nor empty (a constant "
                          "torch.export lifted out of the forward): no rank could give it its value", spec.placement[
                              s.index].loc, hint + "; or make the constant a buffer of its module")]
    return []


def _raising_layer(e: BaseException, module: nn.Module, placed):
    """(segment, placed layer, module path) of the innermost module of `module` whose forward was
    running where `e` (or what caused it) was raised, inside a placed layer; Nones for the glue."""
    paths = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    found = None
    chain: BaseException | None = e
    while chain is not None:
        for frame, _ in traceback.walk_tb(chain.__traceback__):
            path = paths.get(id(frame.f_locals.get("self")))
            if path:
                found = path
        chain = chain.__cause__ or chain.__context__
    for s in placed:
        for layer in s.layers:
            if found and (found == layer or found.startswith(layer + ".")):
                return s, layer, found
    return None, None, None


def _check_outside_reads(spec: Spec, graph: ModelGraph, placed) -> list[Diagnostic]:
    """P098: in lockstep a placed layer's parameters and buffers live on its segment's ranks only
    (the others hold it on the meta device), and only they step them; every rank runs the parent's
    forward. Work outside the layer (the parent's glue, another layer) that reads their values
    would read nothing, or a copy that never trains, on the other ranks."""
    everywhere = set(spec.devices)
    for seg in placed:
        if set(seg.devices) == everywhere:
            continue
        for name in seg.layers:
            read = graph.layer(name).read_outside
            if read:
                tensor, reader = read
                where = f"layer {reader!r}" if reader else "the model's own forward (its glue)"
                return [_diag("P098", f"{where} reads {tensor!r} of layer {name!r} (segment {seg.name!r}) outside that "
                              "layer: in lockstep only the segment's devices hold and train it",
                              spec.placement[seg.index].loc, f"place what reads it in segment {seg.name!r}, read it "
                              "through the layer's own call, or tie it (the same tensor in a module of the reader's "
                              "segment) so placer keeps both copies equal")]
    return []


def _check_loss(spec: Spec, graph: ModelGraph) -> list[Diagnostic]:
    loc = spec.doc.loc(("model", "loss"))
    if spec.model.own_loss:  # output: loss: the model's own, which must be one number
        if graph.output_shape != ():
            what = "no tensor" if graph.output_shape is None else f"a tensor of shape {list(graph.output_shape)}"
            return [_diag("M012", f"model.output is loss, and the forward's loss field is {what}",
                          spec.doc.loc(("model", "output")), "give forward what makes it compute its loss (HF models: "
                          "a `labels` input in model.inputs), or name the output field a loss: takes")]
        return []
    if graph.output_shape is None:
        return [_diag("M008", "the model's forward does not return a tensor", _module_loc(spec),
                      f"model.loss ({spec.model.loss}) is applied to the forward's output; return one tensor")]
    _, target = meta_batch(spec)
    assert graph.output_dtype is not None  # set with output_shape
    output = torch.zeros(graph.output_shape, dtype=getattr(torch, graph.output_dtype), device="meta")
    out, tgt = loss_inputs(spec, output, target)
    what = (f"the model output {list(output.shape)} {graph.output_dtype} and target {list(target.shape)} "
            f"{spec.model.target.dtype}" + ("" if spec.model.inline else
                                            f" (flattened to {list(out.shape)} and {list(tgt.shape)})"))
    hint = "make model.target (shape, dtype, high) match the output"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            getattr(nn, spec.model.loss)()(out, tgt)
        except Exception as e:
            return [_diag("M007", f"{spec.model.loss} cannot take {what}: {_describe(e, spec)}", loc, hint)]
    # e.g. MSELoss broadcasting [B] against [B, 1]: it runs, but computes something else
    return [_diag("W004", f"{spec.model.loss} on {what} warns: {str(w.message).splitlines()[0]}", loc, hint,
                  severity="warning") for w in caught[:1]]


def _check_module_modes(spec: Spec, module: nn.Module, graph: ModelGraph, groups) -> list[Diagnostic]:
    """check.py's layer-kind rules (channel, tensor, spatial, sync_batchnorm) on the module's layers."""
    locs = {}
    for seg, idx in zip(spec.placement, groups):
        for i in idx:
            locs[i] = next((s.loc for s in seg.selectors if _selects(s.text, graph.names, i)), seg.loc)
    layers = []
    for i, info in enumerate(graph.layers):
        cls = type(module.get_submodule(info.name))
        op = cls.__name__ if cls.__module__.startswith("torch.nn") else f"user class {cls.__name__}"
        layers.append(Layer(name=info.name, op=op, loc=locs.get(i, spec.model.loc), norms=info.norms))
    as_inline = dataclasses.replace(spec, model=dataclasses.replace(spec.model, layers=tuple(layers)))
    diags, own = [], set()  # modes with rules of their own on module models (tensor's blocks)
    for seg, idx in zip(spec.placement, groups):
        if len(seg.devices) > 1:
            mode = MODES[seg.parallel.mode]
            why = mode.module_model_blocker(spec, seg)
            if why:  # plain validate's W007, an error once the model is built: plan would show a wrong plan
                diags.append(_diag("P086", f"segment {seg.name!r}: mode {mode.name!r} of a module model {why} is "
                                   "not generated by this version of placer", seg.parallel.loc,
                                   "use mode data or none for that segment, or give the model as inline layers"))
                own.add(seg.index)
                continue
            found = mode.check_module(seg, [graph.layers[i] for i in idx], [layers[i].loc for i in idx],
                                      len(seg.devices))
            if found is not None:
                diags += found
                own.add(seg.index)
    return diags + check.check_layer_kinds(as_inline, groups, skip=own)


def _leaves_as_run(leaves: tuple, dtypes: tuple | None) -> tuple:
    """The traced output leaves with each one's dtype as the run holds it (`dtypes`: autocast's)."""
    if not dtypes or len(dtypes) != len(leaves):
        return leaves
    return tuple(None if leaf is None else (leaf[0], d or leaf[1], leaf[2]) for leaf, d in zip(leaves, dtypes))


def _selects(text: str, names: list[str], i: int) -> bool:
    from placer.spec import select
    hits = select.match(text, names)
    return isinstance(hits, list) and i in hits


# -- diagnostics ------------------------------------------------------------------------------------

def _diag(code, msg, loc, hint=None, severity="error") -> Diagnostic:
    return Diagnostic(code, msg, loc, hint, severity)


def _module_loc(spec: Spec) -> Loc:
    return spec.doc.loc(("model", "module")) if spec.model.module else spec.model.loc


def _user_files(spec: Spec) -> set[str]:
    if spec.model.module and ".py:" in spec.model.module:
        return {_model_file(spec)}
    return set()


def _describe(e: BaseException, spec: Spec) -> str:
    """`ValueError: ...` (the exception's last line) and where in the user's file it was raised."""
    text = traceback.format_exception_only(type(e), e)[-1].strip()
    where = None
    if isinstance(e, SyntaxError) and e.filename:
        where = (e.filename, e.lineno)
    files = _user_files(spec)
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        fname = frame.f_code.co_filename
        if fname in files or (not files and not _is_library(fname)):
            where = (fname, lineno)
    if where and where[0] and os.path.isfile(where[0]):
        text += f" (at {os.path.relpath(where[0], _spec_dir(spec))}:{where[1]})"
    return text


def _is_library(fname: str) -> bool:
    roots = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)), os.path.dirname(os.__file__))
    return fname.startswith(roots) or fname.startswith("<")


def _forward_diag(spec: Spec, module: nn.Module, e: ForwardFailed) -> Diagnostic:
    shape = list(spec.model.input.concrete(spec.training.batch_size))
    what = _describe(e.cause, spec)
    if spec.model.layers is not None:
        layer = next((l for l in spec.model.layers if l.name == e.layer), None)
        if layer is not None:
            return _diag("M006", f"layer {layer.name!r} ({layer.op}) fails on the meta device: {what}", layer.loc,
                         f"fix the layer's arguments so shapes chain from model.input {shape}")
        return _diag("M006", f"the model fails on the meta device: {what}", spec.model.loc)
    where = f" in layer {e.layer!r} ({type(module.get_submodule(e.layer)).__name__})" if e.layer else ""
    return _diag("M006", f"{spec.model.module} forward fails on the meta device{where} with input "
                 f"{shape} {spec.model.input.dtype}: {what}", _module_loc(spec),
                 "check model.input (shape, dtype) against what the model's forward expects")
