"""ModelGraph: the placeable layers of a model with their shapes, sizes and FLOPs.

Produced by `placer.model.build.build_graph(spec)` from a meta-device model
(no weight memory is spent), consumed by placement, estimates and codegen.
All sizes are for one training step on the *global* batch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

INPUT = "input"
"""The model input among a layer's `inputs` and `homes`."""
OUTPUT = "output"
"""The model's output (the loss) among a layer output's consumers."""


@dataclass(frozen=True, kw_only=True)
class LayerInfo:
    name: str
    """Layer name: inline name (`block.2`) or module path (`blocks.2`)."""
    op: str
    """Module class name (`Linear`, `TransformerEncoderLayer`, user class)."""
    params: int
    """Number of trainable parameter elements (owned by this layer, counted once)."""
    param_bytes: int
    buffer_bytes: int
    in_shape: tuple | None
    """Shape of the (first) input, batch dim included, on the global batch; None if unknown."""
    out_shape: tuple | None
    out_dtype: str = "float32"
    out_bytes: int = 0
    """Bytes of the output activation on the global batch (what a copy moves forward)."""
    in_bytes: int = 0
    saved_bytes: int = 0
    """Activation bytes kept for backward (global batch). Each storage counts once, for the
    first layer that saves it (a ReLU output that the next Linear also saves counts for the ReLU);
    parameters do not count. Work between layers counts for the layer that runs next."""
    saves_input: bool = False
    """Whether this layer keeps (a view of) its input for backward. Where a segment starts with
    it, the received copy of the input is kept there too: add `in_bytes` for that segment."""
    inner_grad_bytes: int = 0
    """The most that a backward through the layer's own ops holds in activation gradients (global
    batch): an inner op's output and input gradients (a transformer block's mlp.proj: the block's
    output gradient and the 4x wide hidden one), less what the ops after it saved, freed by then.
    The op that makes the layer's output is left out (its pair is the layer's); 0 for one op."""
    saves_output: bool = False
    """Whether this layer keeps its own output for backward (a ReLU's, a Sigmoid's). Where a
    segment ends with it and sends that output on, the boundary holds it: not counted twice."""
    flops: int = 0
    """Forward FLOPs on the global batch (backward is counted as 2x forward by estimates)."""
    shared_params: int = 0
    """Parameter elements this layer uses that an earlier layer owns (tied weights); not in `params`."""
    inputs: tuple[str, ...] | None = None
    """Layers (or `input`, the model input) whose outputs reach this layer's inputs, through work
    owned by no layer; None when unknown (the model did not trace with fx)."""
    out_kind: str = "tensor"
    """The output's structure: tensor, tuple or list (of tensors and None), or other (a mapping,
    an object): where the layer runs on another rank, the program rebuilds it (module models)."""
    homes: tuple[str, ...] = ()
    """Where its tensor inputs are made when the model is cut at layer boundaries (as
    torch.distributed.pipelining cuts it): layers, or `input`; glue counts for the layer that
    runs after it. A cut before this layer passes each one made in an earlier stage."""
    calls: int = 1
    """How often the forward calls it (a module shared by several layers: more than once)."""
    norms: tuple[int, ...] = ()
    """A module model's layer: the channels of each BatchNorm1d/2d/3d in it (itself included), in
    module order: what sync_batchnorm converts and syncs (an inline layer: its own op says)."""
    out_leaves: tuple = ()
    """Per leaf of the output: (shape, dtype name, requires_grad) on the global batch, or None; the
    dtype as the run holds it (under precision bf16 a module model's autocast dtype, what lockstep sends)."""
    consumers: tuple = ()
    """(output leaf index, the layers (or `output`, the loss) it reaches through work owned by no
    layer, in model order): what crosses a boundary where they run on other devices. Found for
    module models, whatever traced them."""
    projections: tuple = ()
    """Module models: (path inside the layer, class name, in features, out features, has a bias) of each
    Linear-like submodule (torch's Linear, transformers' Conv1D) in registration order: what
    `tensor` splits (placer.modes.tensor.groups)."""
    read_outside: tuple = ()
    """(its parameter or buffer, the layer or None for the parent's glue) where work outside its own
    forward reads its tensors' values: the reader needs them on its own rank."""
    glue_before: bool = False
    """Work owned by no layer (the parent's glue) made a tensor right before its call: a segment
    run as a chain of its layers (channel) would skip it."""
    heads: tuple = ()
    """Module models: (path inside the layer, attribute, value) of the integer head counts its
    submodules (or their `config`) hold: `tensor` divides them by its degree."""
    experts: tuple = ()
    """Module models: (path inside the layer, experts, top k) of each mixture of experts in it. The
    trace runs top k of the experts per token (the grouped matmul's rows): FLOPs and activations
    count what each token visits, whatever the routing, while its experts sit on one device."""
    param_rows: tuple = ()
    """(dim-0 length, bytes per dim-0 row) of each trainable parameter the layer owns: what FSDP2
    pads to a multiple of its group's size (`expert` with `shard: full`)."""
    expert_weights: tuple = ()
    """Module models: (path, hidden size or 0, trainable elements of the experts' weights, stacked,
    router noise) of each mixture of experts of `experts`: stacked, Hugging Face's 3-D weights
    whose dim 0 is the expert (what `expert` parallelism cuts); router noise, a random jitter of
    the router's input in training (Mixtral's `router_jitter_noise`), which differs per rank."""
    head_tensors: tuple = ()
    """Module models: (module path, name, shape) of a parameter or buffer that a module holding a
    head count holds itself with a dim of that size (ALiBi's slopes): `tensor` cannot split it."""
    linear_reads: tuple = ()
    """Module models: (path inside the layer, input number, feeder, tokens, input gets a gradient)
    of each Linear-like submodule's first call on the global batch, in call order: Linears with
    one input number read one tensor (BERT's query, key, value); the feeder is the Linear whose
    output reaches it through elementwise work only; tokens are its input's rows x positions."""
    head_tables: tuple = ()
    """Module models: (path inside the layer, elements) of each Embedding as wide as its parent's
    head count (T5's relative_attention_bias): `tensor` splits it with the heads."""
    window: tuple = ()
    """Module models: (kernel, stride, padding, dilation), each per spatial dim, of a Conv or Pool
    layer with numeric padding: the halos `spatial` exchanges (inline layers: from the spec)."""


@dataclass(frozen=True, kw_only=True)
class RootParam:
    """A parameter or buffer owned by no placeable layer (`self.pos` used in the root's forward).

    It lives on the device of the segment that consumes it (SPEC.md)."""

    name: str
    numel: int
    bytes: int
    trainable: bool
    """False for buffers and frozen parameters."""
    consumer: str | None
    """The layer whose segment first uses it; None if the forward never uses it."""
    users: tuple[str, ...] = ()
    """Every layer (or `output`) that its value reaches through the parent's glue."""


@dataclass(frozen=True, kw_only=True)
class Tie:
    """A trainable parameter that several placeable layers use (GPT-2's `lm_head.weight` is
    `wte.weight`). Counted once, in the first user's `params`; the others' `shared_params`."""

    name: str
    """Its name in `named_parameters()`: the first user's (`wte.weight`)."""
    names: tuple[str, ...]
    """Its name under each user layer, in `layers` order (`wte.weight`, `lm_head.weight`)."""
    layers: tuple[str, ...]
    """The placeable layers that use it, in execution order; the first owns it."""
    aliases: tuple[tuple[str, ...], ...] = ()
    """Every name it has under each of `layers` (T5's `lm_head` and `decoder.embed_tokens` in one
    segment are two names of one copy there: each must be that copy)."""
    numel: int
    bytes: int
    rows: int = 0
    """Its dim 0 (what FSDP2 shards: torch.chunk's pieces, the last ones shorter or empty); 0: unknown."""


@dataclass(frozen=True, kw_only=True)
class ModelGraph:
    layers: tuple[LayerInfo, ...]
    """Placeable layers in execution order."""
    batch_size: int
    input_shape: tuple
    input_dtype: str
    traced_with: str = "inline"
    """How shapes were found: inline | fx | export | hooks."""
    output_shape: tuple | None = None
    """Shape of the model output on the global batch; None if it is not a tensor."""
    output_dtype: str | None = None
    root_params: tuple[RootParam, ...] = ()
    ties: tuple[Tie, ...] = ()
    """Parameters shared by several layers, which every placement keeps one value."""
    loss: str = ""
    """The spec's torch.nn loss on the last layer's output ("": the model's own, or none)."""

    @property
    def names(self) -> list[str]:
        return [l.name for l in self.layers]

    def layer(self, name: str) -> LayerInfo:
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, LayerInfo]:  # (the estimators look layers up by name per op)
        return {l.name: l for l in self.layers}

    @property
    def total_params(self) -> int:
        """Trainable parameter elements, root parameters included."""
        return sum(l.params for l in self.layers) + sum(r.numel for r in self.root_params if r.trainable)
