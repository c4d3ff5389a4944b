"""Export without materializing the model: load a reduced-depth copy, stream the other layers' weights.

A 7 B model is 28 GB in FP32 and the machines users build on have less memory than that. Nothing
in a stage graph needs every weight resident at once: its repeated layers (``model.layers.N``,
``encoder.layers.N``) are one subgraph with different weights. So:

1. :func:`load_reduced` builds the transformers model with each repeated layer stack cut to the
   depth tracing needs (the family's ``stream_depths`` states a :class:`Cut`: two live layers, or
   one traced layer of each kind, after any layers wired in by index), loads only those weights
   (transformers' own ``from_pretrained``, so renamed legacy checkpoint keys, tied weights and computed buffers are
   handled as usual) and marks each cut :class:`torch.nn.ModuleList` with a :class:`Stack`: where
   its weights are in the checkpoint and how deep it really is. The full model is only ever built
   on the meta device (no storage), to learn its key names and shapes.
2. The stage exporter (:func:`vlmc.exporters.base.export_graph`) traces the reduced model and
   hands the graph to :func:`stitch`, which instantiates the last traced layer of each kind once per
   missing layer of that kind, each copy bound to that layer's weights by name.
3. The writer streams each copy's weights from the memory-mapped safetensors shard to the graph's
   data file, one tensor at a time, converted to the graph's dtype (FP32) a block of rows at a time.

Peak memory is the reduced model (embeddings, head, the traced layers per stack) plus one tensor
in flight, whatever the depth. The stitched graph computes what the full-depth trace does, weight
for weight (tests/integration/test_streaming_export.py compares both on onnxruntime for every family). Where the
structure does not allow it (layers that differ beyond their stated kinds, a skip connection across layers, a checkpoint whose layer weights
transformers converts rather than renames), :class:`StitchError` is raised and the exporter falls
back to loading the whole model (vlmc/exporters/__init__.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from vlmc.exporters import checkpoint
from vlmc.exporters import checkpoint as checked  # where a local `checkpoint` is the open Checkpoint

logger = logging.getLogger(__name__)

# Layers traced per stack: the first, whose input comes from outside the stack, and one whose input
# is another layer's output; the second is the template every further layer is copied from.
TRACED_LAYERS = 2


class StitchError(Exception):
    """The streaming export cannot reproduce this model's graph; the caller loads it whole instead."""


@dataclass
class Checkpoint:
    """The safetensors weights of a model directory, by the model's own parameter names."""

    directory: Path
    files: dict[str, tuple[str, str]] = field(default_factory=dict)  # model key -> (shard, checkpoint key)
    # model key -> (start, stop): the weight is these rows of the checkpoint tensor (a fused projection a
    # native rebuild splits, e.g. Qwen-VL's c_attn into q | k | v); only those rows are read
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def tensor(self, key: str) -> torch.Tensor:
        """One weight in the checkpoint's dtype, read from its shard; the shard's mapping is closed
        again at once, so the pages read do not stay in this process's resident set. (The writer
        converts it to the graph's dtype a block at a time.)"""
        from safetensors import safe_open

        shard, name = self.files[key]
        with safe_open(str(self.directory / shard), framework="pt") as f:
            if key in self.rows:
                start, stop = self.rows[key]
                return f.get_slice(name)[start:stop].contiguous()
            return f.get_tensor(name)


@dataclass(frozen=True)
class Cut:
    """How a family cuts one layer stack for a streaming export (what ``stream_depths`` returns).

    - ``depth``: layers loaded and traced.
    - ``kinds``: the kind of every layer of the full stack, when the layers are not all one subgraph
      (Gemma3's sliding / full attention ``layer_types``, BLIP-2's Q-Former layers with and without
      cross-attention). Layers of one kind are one subgraph; each stitched layer copies the last traced
      layer of its kind. None: all alike.
    - ``fixed``: the first ``fixed`` layers are wired to the rest of the graph by their index (Qwen3-VL
      adds a deepstack embedding after each of decoder layers 0..fixed-1, outside the layers). They
      are traced as they are and are never a template; nodes outside the stack may read them.
    """

    depth: int
    kinds: tuple | None = None
    fixed: int = 0


@dataclass
class Stack:
    """A layer stack loaded at reduced depth (set on the cut ModuleList as ``_vlmc_stack``)."""

    prefix: str  # the ModuleList's key prefix in the model, e.g. "model.language_model.layers"
    depth: int  # layers in the checkpoint
    checkpoint: Checkpoint
    kinds: tuple | None = None  # see Cut
    fixed: int = 0

    def key(self, layer: int, rel: str) -> str:
        return f"{self.prefix}.{layer}.{rel}"

    def kind(self, layer: int):
        return None if self.kinds is None else self.kinds[layer]


def stack_of(module: torch.nn.Module) -> Stack | None:
    return getattr(module, "_vlmc_stack", None)


# ----------------------------------------------------------------------------------------- loading


@dataclass
class Layout:
    """A checkpoint against the model its config describes: :func:`layout`."""

    meta: torch.nn.Module  # the full model on the meta device (no storage)
    files: dict[str, tuple[str, str]]  # model key -> (shard, checkpoint key), loaded as they are
    converted: dict[str, list[str]]  # model key -> the checkpoint keys a WeightConverter combines into it


def layout(path: Path, model_class, config, held: dict, trust_remote_code: bool = False) -> Layout:
    """The full model built on the meta device from ``config`` and the checkpoint's tensors ``held``
    (vlmc/exporters/checkpoint.py: headers checked) mapped onto it; refuses a tensor whose shape or dtype
    is not what the config implies (:func:`checkpoint.check_weights`)."""
    # a model class builds from a config with _from_config, an auto class with from_config (which must be
    # told whether the model's own code may run)
    build = getattr(model_class, "_from_config", None)
    with torch.device("meta"):
        if build is not None:
            full = build(copy.deepcopy(config))
        else:
            full = model_class.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code)
    files, converted = _model_keys(full, {k: t.shard for k, t in held.items()})
    checkpoint.check_weights(path, full.state_dict(), files, converted, held)
    return Layout(full, files, converted)


@contextlib.contextmanager
def quiet_loading():
    """transformers' load report and progress bars off while it loads: vlmc states what matters in one line
    (a missing weight refuses the export, :func:`checkpoint.refuse_missing`)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _model_keys(meta_model, ckpt: dict[str, str]) -> tuple[dict[str, tuple[str, str]], dict[str, list[str]]]:
    """Map checkpoint keys to the model's parameter names with transformers' own renaming rules.

    Keys a WeightConverter (split, merge, permute) would produce are returned apart: their bytes
    are not one checkpoint tensor, so they cannot be streamed as they are.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(meta_model)
    renamings = [e for e in mapping if isinstance(e, WeightRenaming)]
    converters = [e for e in mapping if isinstance(e, WeightConverter)]
    meta_sd = meta_model.state_dict()
    prefix = meta_model.base_model_prefix
    files: dict[str, tuple[str, str]] = {}
    converted: dict[str, list[str]] = {}
    for key in sorted(ckpt):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
        if renamed not in meta_sd and key in meta_sd:
            renamed, pattern = key, None
        if pattern is not None:
            converted.setdefault(renamed, []).append(key)
        elif renamed in meta_sd:
            files[renamed] = (ckpt[key], key)
    return files, converted


def reduce_config(config, depths: dict[tuple[str, str], Cut]):
    """A copy of ``config`` with each (sub-config, field) layer count set to its traced depth."""
    reduced = copy.deepcopy(config)
    for (sub, fld), cut in depths.items():
        target = reduced if sub == "" else getattr(reduced, sub)
        setattr(target, fld, cut.depth)
        types = getattr(target, "layer_types", None)
        if isinstance(types, list):
            target.layer_types = types[: cut.depth]
    return reduced


def decoder_depths(config, fixed: int = 0) -> dict[tuple[str, str], Cut]:
    """The default cut: the text decoder's layers (by their ``layer_types``, if they differ).

    ``fixed``: layers at the start of the stack that the graph outside it reads or writes by index
    (see :attr:`Cut.fixed`)."""
    sub = "text_config" if getattr(config, "text_config", None) is not None else ""
    return uniform_depth(config, sub, "num_hidden_layers", TRACED_LAYERS, fixed=fixed)


def feature_layer_depth(config, sub: str = "vision_config", fld: str = "num_hidden_layers") -> dict:
    """The vision tower's cut when the features are ``hidden_states[f]`` of one layer, f < 0.

    The layers after the picked one are dead (the exporter drops them), so a tower cut to 1 - f layers
    traces two live ones and the stitched graph ends at layer L + f like the full one. A list of
    feature layers (several layers read by the head) or f >= 0 is not cut: {}.
    """
    f = getattr(config, "vision_feature_layer", None)
    if not isinstance(f, int) or isinstance(f, bool) or f >= 0:
        return {}
    return uniform_depth(config, sub, fld, 1 - f)


def traced_depth(kinds, traced: int, fixed: int = 0) -> int | None:
    """Layers to trace so that every kind of layer after them has a template.

    A template is a traced layer after the fixed ones whose input is another such layer's output
    (index > ``fixed``); it must be the same kind as the layers copied from it. None when the trace
    would be the whole stack.
    """
    n = len(kinds)
    depth = max(traced, fixed + TRACED_LAYERS)
    while depth < n and not set(kinds[depth:]) <= set(kinds[fixed + 1 : depth]):
        depth += 1
    return depth if depth < n else None


def uniform_depth(
    config, sub: str, fld: str, traced: int, kinds=None, fixed: int = 0
) -> dict[tuple[str, str], Cut]:
    """{(sub, fld): Cut} when that stack is deeper than its trace.

    ``kinds`` (one per layer) default to the sub-config's ``layer_types`` when they differ; the
    traced depth then covers one layer of each kind after the first (:func:`traced_depth`).
    """
    target = config if sub == "" else getattr(config, sub, None)
    n = getattr(target, fld, None)
    if not isinstance(n, int) or n <= max(traced, fixed + TRACED_LAYERS):
        return {}
    if kinds is None:
        types = getattr(target, "layer_types", None)
        if isinstance(types, list) and len(types) == n and len(set(types)) > 1:
            kinds = types
    if kinds is not None:
        kinds = tuple(kinds)
        if len(kinds) != n:
            return {}
        if len(set(kinds)) == 1:
            kinds = None
    depth = max(traced, fixed + TRACED_LAYERS)
    if kinds is not None:
        depth = traced_depth(kinds, traced, fixed)
        if depth is None:
            return {}
    return {(sub, fld): Cut(depth, kinds, fixed)}


def load_reduced(path: Path, model_class, config, depths: dict[tuple[str, str], Cut | int], lay: Layout):
    """The model with each stack in ``depths`` cut to its traced depth, loaded in FP32 from ``path``.

    ``lay``: the checkpoint against the full model (:func:`layout`). Returns
    ``(model, full_config)``, or None when the checkpoint's layer weights cannot be streamed (the caller
    loads the whole model). Each cut ModuleList carries its :class:`Stack`. A weight the full model needs
    that the checkpoint does not hold refuses the export (VlmcError naming it), as in a whole load.
    """
    depths = {k: v if isinstance(v, Cut) else Cut(int(v)) for k, v in depths.items()}
    full, converted = lay.meta, lay.converted
    checkpoint = Checkpoint(path, lay.files)
    reduced_cfg = reduce_config(config, depths)
    with quiet_loading():  # the cut layers' weights are "unexpected keys"
        model, info = model_class.from_pretrained(
            str(path),
            config=reduced_cfg,
            use_safetensors=True,
            dtype="float32",
            attn_implementation="eager",
            output_loading_info=True,
            trust_remote_code=False,  # load_source streams only models without their own code
        )
    checked.refuse_missing(path, info)
    # Weights the full model does not need from the checkpoint: tied to another, or ones transformers is told
    # to leave to their initializer. A stitched layer with one of those is loaded whole instead.
    optional = set(getattr(full, "all_tied_weights_keys", None) or ())
    ignored = [re.compile(p) for p in getattr(full, "_keys_to_ignore_on_load_missing", None) or ()]
    model.eval()
    full_modules = dict(full.named_modules())
    full_params = dict(full.named_parameters())
    cut = 0
    for name, ml in model.named_modules():
        ref = full_modules.get(name)
        if not isinstance(ml, torch.nn.ModuleList) or not isinstance(ref, torch.nn.ModuleList):
            continue
        if len(ref) <= len(ml):
            continue
        cuts = [
            c
            for (sub, fld), c in depths.items()
            if c.depth == len(ml) and _count(config, sub, fld) == len(ref)
        ]
        if len({(c.kinds, c.fixed) for c in cuts}) != 1:
            logger.info("streaming export: cannot tell which cut %s is; loading whole", name)
            return None
        stack = Stack(
            prefix=name, depth=len(ref), checkpoint=checkpoint, kinds=cuts[0].kinds, fixed=cuts[0].fixed
        )
        for j in range(len(ml), len(ref)):
            for rel, p in ref[j].named_parameters():
                key = stack.key(j, rel)
                if key not in converted and key not in checkpoint and key not in optional:
                    if not any(p.search(key) for p in ignored):
                        checked.refuse_missing(path, {"missing_keys": [key]})
                if key in converted or key not in checkpoint:
                    logger.info("streaming export: %s is not one checkpoint tensor; loading whole", key)
                    return None
                if tuple(full_params[key].shape) != tuple(p.shape):
                    return None
        ml._vlmc_stack = stack
        cut += 1
    if cut != len(depths):
        logger.info("streaming export: found %d of %d cut layer stacks; loading whole", cut, len(depths))
        return None
    # The source's config is the model's own (as from_pretrained set it up) at full depth.
    full_config = copy.deepcopy(model.config)
    for (sub, fld), _ in depths.items():
        src = config if sub == "" else getattr(config, sub)
        dst = full_config if sub == "" else getattr(full_config, sub)
        setattr(dst, fld, getattr(src, fld))
        if isinstance(getattr(src, "layer_types", None), list):
            dst.layer_types = list(src.layer_types)
    return model, full_config


def _count(config, sub: str, fld: str):
    return getattr(config if sub == "" else getattr(config, sub, None), fld, None)


# --------------------------------------------------------------------------------------- stitching


@dataclass
class Copy:
    """One weight of a stitched layer: graph initializer ``name`` holds ``stack``'s ``key``."""

    name: str
    key: str | None  # checkpoint key (model naming); None: same value as the template's tensor
    template: str  # the traced initializer it copies
    transposed: bool  # stored as [in, out] (see base._linear_weights_transposed)
    stack: Stack


def _stack_scope(graph, path: str) -> str | None:
    """The node-name prefix of the stack at module ``path`` in a TorchScript-exported graph, e.g.
    ``/vision_tower/encoder/layers.`` for ``model.model.vision_tower.encoder.layers``.

    The exporter names a node by the chain of module *calls* it ran in, each by its attribute name
    (``layers.3`` for a ModuleList entry), not by the module's full path: a wrapper that calls
    ``model.get_image_features`` skips ``model``, one that calls a block directly skips its parents.
    So the prefix is found in the node names: ``.../<list name>.<i>/`` whose call levels are a
    subsequence of ``path``'s. None if no node is in such a scope; several candidates are an error.
    """
    *parents, last = path.split(".")
    found = set()
    for node in graph.node:
        head = node.name.split(f"/{last}.", 1)
        if len(head) != 2 or not head[1].split("/", 1)[0].isdigit() or not node.name.startswith("/"):
            continue
        levels = [x for x in head[0].split("/") if x]
        it = iter(parents)
        if all(level in it for level in levels):  # a subsequence of the path's modules
            found.add(head[0] + f"/{last}.")
    if len(found) > 1:
        raise StitchError(f"{path}: its layers appear under several scopes {sorted(found)}")
    return found.pop() if found else None


@dataclass
class _Template:
    """What one template layer's subgraph reads and writes (see :func:`stitch`)."""

    layer: int
    nodes: list[int]
    produced: set[str]
    weights: list[str]
    layer_inputs: list[str]
    layer_outputs: list[str]
    carry_in: list[str]  # the previous layer's outputs it reads
    carry_out: list[str]  # its outputs the next layer (or, for the last layer, the head) reads

    @property
    def per_layer(self) -> set[str]:
        return set(self.weights) | set(self.layer_inputs) | set(self.layer_outputs)


def stitch(model: onnx.ModelProto, path: str, stack: Stack, traced: int) -> list[Copy]:
    """Grow the traced graph's stack at module ``path`` to its full depth, in place.

    ``path`` is the stack's module path in the traced wrapper (its node scope is ``/path/N/...``
    with dots as slashes, its parameters ``path.N.rel``); ``traced`` is how many layers it had.
    Each added layer copies a template: the last live traced layer of its kind (``stack.kinds``; one
    kind unless the family says otherwise), after the ``stack.fixed`` layers. A copy gets the
    template's nodes with the layer index renamed, its inputs from the previous layer where the
    template's come from the layer before it, and its own weights and per-layer graph inputs and
    outputs (``past_key_values.N.key`` ...). Returns the weights the writer must add. Raises
    :class:`StitchError` when the graph is not a chain of layers that match their templates.
    """
    graph = model.graph
    pname = path + "."
    scope = _stack_scope(graph, path)
    if scope is None:
        if any(v.name.startswith(pname) for v in (*graph.input, *graph.initializer)):
            raise StitchError(f"{path}: its weights are in the graph but no node carries its layer scope")
        return []  # the wrapper holds the stack but this graph does not use it

    def layer_of_name(name: str) -> int | None:
        if not name.startswith(scope):
            return None
        idx = name[len(scope) :].split("/", 1)[0]
        return int(idx) if idx.isdigit() else None

    def local(name: str, a: int) -> str | None:
        """``name`` without layer ``a``'s scope (None if it is not in that scope)."""
        head = f"{scope}{a}/"
        return name[len(head) :] if name.startswith(head) else None

    producers: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for o in node.output:
            producers[o] = i
        for x in node.input:
            if x:
                consumers.setdefault(x, []).append(i)
    layer = [layer_of_name(n.name) for n in graph.node]
    # Unscoped constants (torch leaves some unnamed) belong to the one layer that uses them.
    for i, node in enumerate(graph.node):
        if layer[i] is None and not node.input:
            users = {layer[c] for o in node.output for c in consumers.get(o, [])}
            if len(users) == 1 and None not in users:
                layer[i] = users.pop()
    live = sorted({x for x in layer if x is not None})
    m = len(live)
    if m < 2 or live != list(range(m)):
        raise StitchError(f"{path}: traced layers {live} are not 0..N with N >= 1")
    extra = stack.depth - traced
    if extra <= 0:
        return []
    last = m + extra  # live layers in the full graph
    fixed = stack.fixed
    if m - 1 <= fixed:
        raise StitchError(f"{path}: {m} live traced layers leave no template after the {fixed} fixed ones")
    # The template of a kind: its last live traced layer whose input is another non-fixed layer's output.
    template_of = {stack.kind(j): j for j in range(fixed + 1, m)}
    missing = {stack.kind(j) for j in range(m, last)} - set(template_of)
    if missing:
        raise StitchError(f"{path}: no traced layer of kind {sorted(map(str, missing))} to copy")

    # Values that depend on some layer's weights. torch's exporter shares a computation that only
    # depends on shared values between layers (every layer reads layer 0's unsqueezed cos/sin):
    # such values are shared in the full-depth graph too, so copies read them as they are. A
    # weight-dependent value crossing into a template is the carried state, and only from the
    # layer before it.
    tainted = {x.name for x in graph.input if x.name.startswith(pname)}
    tainted |= {x.name for x in graph.initializer if x.name.startswith(pname)}
    for node in graph.node:
        if any(x in tainted for x in node.input):
            tainted.update(node.output)
    graph_inputs = {v.name for v in graph.input}
    graph_outputs = {v.name for v in graph.output}
    inits = {x.name for x in graph.initializer}

    def rescope(name: str, a: int, b: int) -> str:
        rest = local(name, a)
        return name if rest is None else f"{scope}{b}/{rest}"

    def reindex(name: str, a: int, b: int) -> str:
        if f".{a}." not in name:
            raise StitchError(f"{path}: per-layer tensor {name} does not name its layer")
        return name.replace(f".{a}.", f".{b}.", 1)

    def analyse(t: int) -> _Template:
        p = t - 1
        nodes = [i for i in range(len(graph.node)) if layer[i] == t]
        tset = set(nodes)
        produced = {o for i in nodes for o in graph.node[i].output}
        weights, layer_inputs, carry_in = [], [], []
        for x in dict.fromkeys(x for i in nodes for x in graph.node[i].input if x and x not in produced):
            if x.startswith(f"{pname}{t}."):
                weights.append(x)
            elif x.startswith(pname):
                raise StitchError(f"{path}: layer {t} uses another layer's weight {x}")
            elif x in graph_inputs:
                if f".{t}." in x:
                    if not all(c in tset for c in consumers[x]):
                        raise StitchError(f"{path}: per-layer input {x} is read outside layer {t}")
                    layer_inputs.append(x)
            elif x in inits:
                if all(c in tset for c in consumers[x]):
                    raise StitchError(f"{path}: layer {t} has its own constant {x} that is not a weight")
            elif x in tainted:
                src = layer[producers[x]] if x in producers else None
                if src != p:
                    raise StitchError(f"{path}: layer {t} reads {x}, which depends on other layers' weights")
                if any(layer[c] not in (p, t) for c in consumers[x]):
                    raise StitchError(f"{path}: layer {p}'s {x} is read outside layers {p} and {t}")
                carry_in.append(x)
        layer_outputs, carry_out = [], []
        readers = {None} if t == m - 1 else {t + 1}  # the head reads the last layer; the next, the others
        for o in sorted(produced):
            users = [c for c in consumers.get(o, []) if c not in tset]
            if o in graph_outputs:
                if f".{t}." not in o or users:
                    raise StitchError(f"{path}: layer {t}'s output {o} is not per-layer")
                layer_outputs.append(o)
            elif users:
                if any(layer[c] not in readers for c in users):
                    raise StitchError(f"{path}: layer {t}'s {o} is read by another layer")
                carry_out.append(o)
        if not any(o in tainted for o in carry_out):
            raise StitchError(f"{path}: layer {t}'s outputs do not depend on its weights")
        return _Template(t, nodes, produced, weights, layer_inputs, layer_outputs, carry_in, carry_out)

    templates = {t: analyse(t) for t in sorted(set(template_of.values()) | {m - 1})}
    # Every layer hands the next the same values, named alike inside its scope, whatever its kind:
    # then a copy's inputs are the previous layer's outputs of the same local names.
    carried = None
    for t, info in templates.items():
        outs = [local(o, t) for o in info.carry_out]
        ins = [local(x, t - 1) for x in info.carry_in]
        if None in outs or None in ins:
            raise StitchError(f"{path}: layer {t}'s carried values are not named in its scope")
        carried = sorted(outs) if carried is None else carried
        if sorted(outs) != carried or sorted(ins) != carried:
            raise StitchError(
                f"{path}: layer {t} reads {sorted(ins)} and writes {sorted(outs)}, not {carried}"
            )
    for i, node in enumerate(graph.node):
        if layer[i] is None:
            for x in node.input:
                src = layer[producers[x]] if x in tainted and x in producers else None
                if src is not None and src != m - 1 and src >= fixed:
                    raise StitchError(f"{path}: {node.name} reads layer {src}'s {x}")

    def rename(name: str, j: int, info: _Template) -> str:
        t = info.layer
        if name in info.weights:
            return f"{pname}{j}." + name[len(f"{pname}{t}.") :]
        if name in info.layer_inputs or name in info.layer_outputs:
            return reindex(name, t, j)
        if name in info.carry_in:  # the previous layer's output of the same local name
            return f"{scope}{j - 1}/" + local(name, t - 1)
        if name in info.produced:
            return rescope(name, t, j) if local(name, t) is not None else f"{scope}{j}/{name}"
        return name  # shared: graph inputs, constants, values computed before the stack

    plan = [(j, templates[template_of[stack.kind(j)]]) for j in range(m, last)]
    new_nodes = []
    for j, info in plan:
        t = info.layer
        for i in info.nodes:
            n = onnx.NodeProto()
            n.CopyFrom(graph.node[i])
            n.name = rescope(n.name, t, j) if local(n.name, t) is not None else f"{scope}{j}/{n.name}"
            n.input[:] = [rename(x, j, info) if x else x for x in n.input]
            n.output[:] = [rename(o, j, info) for o in n.output]
            new_nodes.append(n)
    # The rest of the graph reads the last copy's output instead of the last traced layer's.
    final = {o: f"{scope}{last - 1}/" + local(o, m - 1) for o in templates[m - 1].carry_out}
    for i, node in enumerate(graph.node):
        if layer[i] is None:
            node.input[:] = [final.get(x, x) for x in node.input]
    nodes = list(graph.node)
    at = max(i for info in templates.values() for i in info.nodes) + 1
    del graph.node[:]
    graph.node.extend(nodes[:at] + new_nodes + nodes[at:])

    def grow(values, field_name: str) -> None:
        names = {n for info in templates.values() for n in getattr(info, field_name)}
        if not names:
            return
        items = list(values)
        by_name = {v.name: v for v in items}
        pos = max(k for k, v in enumerate(items) if v.name in names) + 1
        added = []
        for j, info in plan:
            for name in getattr(info, field_name):
                c = onnx.ValueInfoProto()
                c.CopyFrom(by_name[name])
                c.name = reindex(name, info.layer, j)
                added.append(c)
        del values[:]
        values.extend(items[:pos] + added + items[pos:])

    # graph inputs / outputs in layer order, as the full trace has them
    for info in templates.values():
        order = [v.name for v in graph.input if v.name in info.layer_inputs]
        info.layer_inputs = order
        info.layer_outputs = [v.name for v in graph.output if v.name in info.layer_outputs]
    grow(graph.input, "layer_inputs")
    grow(graph.output, "layer_outputs")
    infos = {
        t: [v for v in graph.value_info if v.name in info.produced and v.name not in info.per_layer]
        for t, info in templates.items()
    }
    for j, info in plan:
        for v in infos[info.layer]:
            c = graph.value_info.add()
            c.CopyFrom(v)
            c.name = rename(v.name, j, info)

    copies = []  # layer by layer, so each shard is read front to back
    for j, info in plan:
        t = info.layer
        for w in info.weights:
            rel = w[len(f"{pname}{t}.") :]
            transposed = rel.endswith(".weight_t")
            if transposed:
                rel = rel[: -len("_t")]
            key = stack.key(j, rel)
            copies.append(
                Copy(
                    name=rename(w, j, info),
                    key=key if key in stack.checkpoint else None,
                    template=w,
                    transposed=transposed,
                    stack=stack,
                )
            )
    logger.info(
        "%s: stitched layers %d..%d from layer(s) %s",
        path,
        m,
        last - 1,
        sorted({t for _, t in template_of.items()}),
    )
    return copies
