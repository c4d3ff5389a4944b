"""Export without materializing the model: load a reduced-depth copy, stream the other layers' weights.

A 7 B model is 28 GB in FP32 and the machines users build on have less memory than that. Nothing
in a stage graph needs every weight resident at once: its repeated layers (``model.layers.N``,
``encoder.layers.N``) are one subgraph with different weights. So:

1. :func:`load_reduced` builds the transformers model with each repeated layer stack cut to the
   depth tracing needs (two live layers), loads only those weights (transformers' own
   ``from_pretrained``, so renamed legacy checkpoint keys, tied weights and computed buffers are
   handled as usual) and marks each cut :class:`torch.nn.ModuleList` with a :class:`Stack`: where
   its weights are in the checkpoint and how deep it really is. The full model is only ever built
   on the meta device (no storage), to learn its key names and shapes.
2. The stage exporter (:func:`vlmc.exporters.base.export_graph`) traces the reduced model and
   hands the graph to :func:`stitch`, which instantiates the last traced layer's subgraph once per
   missing layer, each copy bound to that layer's weights by name.
3. The writer streams each copy's weights from the memory-mapped safetensors shard to the graph's
   data file, one tensor at a time, converted to the graph's dtype (FP32) a block of rows at a time.

Peak memory is the reduced model (embeddings, head, two layers per stack) plus one tensor in
flight, whatever the depth. The stitched graph is the graph the full-depth trace gives, node for
node (tests/test_streaming_export.py compares both on onnxruntime). Where the structure does not
allow it (layers that differ, a skip connection across layers, a checkpoint whose layer weights
transformers converts rather than renames), :class:`StitchError` is raised and the exporter falls
back to loading the whole model (vlmc/exporters/__init__.py).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

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

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def tensor(self, key: str) -> torch.Tensor:
        """One weight in the checkpoint's dtype, read from its shard; the shard's mapping is closed
        again at once, so the pages read do not stay in this process's resident set. (The writer
        converts it to the graph's dtype a block at a time.)"""
        from safetensors import safe_open

        shard, name = self.files[key]
        with safe_open(str(self.directory / shard), framework="pt") as f:
            return f.get_tensor(name)


@dataclass
class Stack:
    """A layer stack loaded at reduced depth (set on the cut ModuleList as ``_vlmc_stack``)."""

    prefix: str  # the ModuleList's key prefix in the model, e.g. "model.language_model.layers"
    depth: int  # layers in the checkpoint
    checkpoint: Checkpoint

    def key(self, layer: int, rel: str) -> str:
        return f"{self.prefix}.{layer}.{rel}"


def stack_of(module: torch.nn.Module) -> Stack | None:
    return getattr(module, "_vlmc_stack", None)


# ----------------------------------------------------------------------------------------- loading


def checkpoint_index(directory: Path) -> dict[str, str]:
    """Checkpoint key -> shard file name, from the index save_pretrained writes (or the single file)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: shard.name for k in f.keys()})
    return out


def _model_keys(meta_model, ckpt: dict[str, str]) -> tuple[dict[str, tuple[str, str]], set[str]]:
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
    converted: set[str] = set()
    for key in sorted(ckpt):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
        if renamed not in meta_sd and key in meta_sd:
            renamed, pattern = key, None
        if pattern is not None:
            converted.add(renamed)
        elif renamed in meta_sd:
            files[renamed] = (ckpt[key], key)
    return files, converted


def reduce_config(config, depths: dict[tuple[str, str], int]):
    """A copy of ``config`` with each (sub-config, field) layer count set to its traced depth."""
    reduced = copy.deepcopy(config)
    for (sub, fld), depth in depths.items():
        target = reduced if sub == "" else getattr(reduced, sub)
        setattr(target, fld, depth)
        types = getattr(target, "layer_types", None)
        if isinstance(types, list):
            target.layer_types = types[:depth]
    return reduced


def decoder_depths(config) -> dict[tuple[str, str], int]:
    """The default cut: the text decoder's layers, when they are all alike and there are more than two."""
    sub = "text_config" if getattr(config, "text_config", None) is not None else ""
    return uniform_depth(config, sub, "num_hidden_layers", TRACED_LAYERS)


def uniform_depth(config, sub: str, fld: str, traced: int) -> dict[tuple[str, str], int]:
    """{(sub, fld): traced} when that stack is deeper than ``traced`` and its layers are all one type."""
    target = config if sub == "" else getattr(config, sub, None)
    n = getattr(target, fld, None)
    if not isinstance(n, int) or n <= traced:
        return {}
    types = getattr(target, "layer_types", None)
    if isinstance(types, list) and len(set(types)) > 1:
        return {}  # e.g. sliding and full attention layers: not one repeated subgraph
    return {(sub, fld): traced}


def load_reduced(path: Path, model_class, config, depths: dict[tuple[str, str], int]):
    """The model with each stack in ``depths`` cut to its traced depth, loaded in FP32 from ``path``.

    Returns ``(model, full_config)``, or None when the checkpoint's layer weights cannot be streamed
    (the caller loads the whole model). Each cut ModuleList carries its :class:`Stack`.
    """
    import transformers

    ckpt = checkpoint_index(path)
    with torch.device("meta"):
        full = model_class._from_config(copy.deepcopy(config))
    files, converted = _model_keys(full, ckpt)
    checkpoint = Checkpoint(path, files)
    reduced_cfg = reduce_config(config, depths)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the cut layers' weights are "unexpected keys"
    try:
        model = model_class.from_pretrained(
            str(path),
            config=reduced_cfg,
            use_safetensors=True,
            dtype="float32",
            attn_implementation="eager",
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
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
        stack = Stack(prefix=name, depth=len(ref), checkpoint=checkpoint)
        for j in range(len(ml), len(ref)):
            for rel, p in ref[j].named_parameters():
                key = stack.key(j, rel)
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


# --------------------------------------------------------------------------------------- stitching


@dataclass
class Copy:
    """One weight of a stitched layer: graph initializer ``name`` holds ``stack``'s ``key``."""

    name: str
    key: str | None  # checkpoint key (model naming); None: same value as the template's tensor
    template: str  # the traced initializer it copies
    transposed: bool  # stored as [in, out] (see base._linear_weights_transposed)
    stack: Stack


def stitch(model: onnx.ModelProto, path: str, stack: Stack, traced: int) -> list[Copy]:
    """Grow the traced graph's stack at module ``path`` to its full depth, in place.

    ``path`` is the stack's module path in the traced wrapper (its node scope is ``/path/N/...``
    with dots as slashes, its parameters ``path.N.rel``); ``traced`` is how many layers it had.
    The last live layer is the template: every copy gets its nodes with the layer index renamed,
    its inputs from the previous copy where the template's come from the layer before it, and its
    own weights and per-layer graph inputs and outputs (``past_key_values.N.key`` ...). Returns the
    weights the writer must add. Raises :class:`StitchError` when the graph is not a chain of
    identical layers.
    """
    g = model.graph
    scope = "/" + path.replace(".", "/") + "."
    pname = path + "."

    def layer_of_name(name: str) -> int | None:
        if scope not in name:
            return None
        rest = name.split(scope, 1)[1]
        idx = rest.split("/", 1)[0]
        return int(idx) if idx.isdigit() else None

    producers: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(g.node):
        for o in node.output:
            producers[o] = i
        for x in node.input:
            if x:
                consumers.setdefault(x, []).append(i)
    layer = [layer_of_name(n.name) for n in g.node]
    # Unscoped constants (torch leaves some unnamed) belong to the one layer that uses them.
    for i, node in enumerate(g.node):
        if layer[i] is None and not node.input:
            users = {layer[c] for o in node.output for c in consumers.get(o, [])}
            if len(users) == 1 and None not in users:
                layer[i] = users.pop()
    live = sorted({x for x in layer if x is not None})
    m = len(live)
    if m < 2 or live != list(range(m)):
        raise StitchError(f"{path}: traced layers {live} are not 0..N with N >= 1")
    t, p = m - 1, m - 2
    extra = stack.depth - traced
    if extra <= 0:
        return []
    last = m + extra  # live layers in the full graph

    T = [i for i in range(len(g.node)) if layer[i] == t]
    tset = set(T)
    # Values that depend on some layer's weights. torch's exporter shares a computation that only
    # depends on shared values between layers (every layer reads layer 0's unsqueezed cos/sin):
    # such values are shared in the full-depth graph too, so copies read them as they are. A
    # weight-dependent value crossing into the template is the carried state, and only from the
    # layer before it.
    tainted = {x.name for x in g.input if x.name.startswith(pname)}
    tainted |= {x.name for x in g.initializer if x.name.startswith(pname)}
    for node in g.node:
        if any(x in tainted for x in node.input):
            tainted.update(node.output)
    produced = {o for i in T for o in g.node[i].output}
    graph_inputs = {v.name for v in g.input}
    graph_outputs = {v.name for v in g.output}
    inits = {x.name for x in g.initializer}

    def rescope(name: str, a: int, b: int) -> str:
        return name.replace(f"{scope}{a}/", f"{scope}{b}/")

    def reindex(name: str, a: int, b: int) -> str:
        if f".{a}." not in name:
            raise StitchError(f"{path}: per-layer tensor {name} does not name its layer")
        return name.replace(f".{a}.", f".{b}.", 1)

    weights, layer_inputs, carry_in = [], [], []
    for x in dict.fromkeys(x for i in T for x in g.node[i].input if x and x not in produced):
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
            carry_in.append(x)
    layer_outputs, carry_out = [], []
    for o in sorted(produced):
        users = [c for c in consumers.get(o, []) if c not in tset]
        if o in graph_outputs:
            if f".{t}." not in o or users:
                raise StitchError(f"{path}: layer {t}'s output {o} is not per-layer")
            layer_outputs.append(o)
        elif users:
            if any(layer[c] is not None for c in users):
                raise StitchError(f"{path}: layer {t}'s {o} is read by another layer")
            carry_out.append(o)
    for i, node in enumerate(g.node):
        if layer[i] is None:
            for x in node.input:
                if x in tainted and x in producers and layer[producers[x]] not in (None, t):
                    raise StitchError(f"{path}: {node.name} reads layer {layer[producers[x]]}'s {x}")
    if sorted(rescope(c, p, t) for c in carry_in) != carry_out or not carry_out:
        raise StitchError(f"{path}: layer {t}'s inputs {carry_in} do not match its outputs {carry_out}")
    for x in carry_in:
        if any(layer[c] not in (p, t) for c in consumers[x]):
            raise StitchError(f"{path}: layer {p}'s {x} is read outside layers {p} and {t}")
    if any(o in tainted for o in carry_out) is False:
        raise StitchError(f"{path}: layer {t}'s outputs do not depend on its weights")

    per_layer = set(weights) | set(layer_inputs) | set(layer_outputs)

    def rename(name: str, j: int) -> str:
        if name in weights:
            return f"{pname}{j}." + name[len(f"{pname}{t}.") :]
        if name in per_layer:
            return reindex(name, t, j)
        if name in carry_in:  # the previous copy's output
            return rescope(rescope(name, p, t), t, j - 1)
        if name in produced:
            return rescope(name, t, j) if f"{scope}{t}/" in name else f"{scope}{j}/{name}"
        return name  # shared: graph inputs, constants, values computed before the stack

    new_nodes = []
    for j in range(m, last):
        for i in T:
            n = onnx.NodeProto()
            n.CopyFrom(g.node[i])
            n.name = rescope(n.name, t, j) if f"{scope}{t}/" in n.name else f"{scope}{j}/{n.name}"
            n.input[:] = [rename(x, j) if x else x for x in n.input]
            n.output[:] = [rename(o, j) for o in n.output]
            new_nodes.append(n)
    # The rest of the graph reads the last copy's output instead of the template's.
    final = {o: rescope(o, t, last - 1) for o in carry_out}
    for i, node in enumerate(g.node):
        if layer[i] is None:
            node.input[:] = [final.get(x, x) for x in node.input]
    nodes = list(g.node)
    at = max(T) + 1
    del g.node[:]
    g.node.extend(nodes[:at] + new_nodes + nodes[at:])

    def grow(values, names: list[str]) -> None:
        if not names:
            return
        items = list(values)
        pos = max(k for k, v in enumerate(items) if v.name in names) + 1
        added = []
        for j in range(m, last):
            for v in items:
                if v.name in names:
                    c = onnx.ValueInfoProto()
                    c.CopyFrom(v)
                    c.name = reindex(v.name, t, j)
                    added.append(c)
        del values[:]
        values.extend(items[:pos] + added + items[pos:])

    grow(g.input, layer_inputs)
    grow(g.output, layer_outputs)
    infos = [v for v in g.value_info if v.name in produced and v.name not in per_layer]
    for j in range(m, last):
        for v in infos:
            c = g.value_info.add()
            c.CopyFrom(v)
            c.name = rename(v.name, j)

    copies = []  # layer by layer, so each shard is read front to back
    for j in range(m, last):
        for w in weights:
            rel = w[len(f"{pname}{t}.") :]
            transposed = rel.endswith(".weight_t")
            if transposed:
                rel = rel[: -len("_t")]
            key = stack.key(j, rel)
            copies.append(
                Copy(
                    name=rename(w, j),
                    key=key if key in stack.checkpoint else None,
                    template=w,
                    transposed=transposed,
                    stack=stack,
                )
            )
    logger.info("%s: stitched layers %d..%d from layer %d's subgraph", path, m, last - 1, t)
    return copies
