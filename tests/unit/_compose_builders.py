"""Small hand-built stage graphs (onnx_ir) and packages for the merge and split unit tests.

The stages have the standard interfaces (docs/architecture.md "Graph IO"): a vision graph
``pixel_values -> image_features``, an embedding ``input_ids -> inputs_embeds`` and a decoder
``inputs_embeds, attention_mask, past KV -> logits, present KV`` made of residual layers. Every
weight is large enough (>= 1 KiB) to be stored as external data, so a loaded package holds it as a
memory-mapped ``ir.ExternalTensor``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import onnx_ir as ir

from vlmc import graphs, interop, tensor_names
from vlmc.package import Package

HIDDEN = 16
VOCAB = 40
IMAGE_TOKEN = VOCAB - 1
PATCHES = 4  # image features per image
PATCH_DIM = 24
FLOAT = ir.DataType.FLOAT
INT64 = ir.DataType.INT64


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[ir.Node] = []
        self.inits: list[ir.Value] = []

    def weight(self, name: str, *shape: int) -> ir.Value:
        arr = (self.rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
        v = ir.Value(
            name=name, shape=ir.Shape(shape), type=ir.TensorType(FLOAT), const_value=ir.tensor(arr, name=name)
        )
        self.inits.append(v)
        return v

    def const(self, name: str, arr) -> ir.Value:
        arr = np.asarray(arr)
        t = ir.tensor(arr, name=name)
        v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(t.dtype), const_value=t)
        self.inits.append(v)
        return v

    def op(self, op_type: str, inputs: list, name: str, **attributes) -> ir.Value:
        node = ir.node(op_type, inputs, attributes=attributes or None, name=f"{name}_node")
        node.outputs[0].name = name
        self.nodes.append(node)
        return node.outputs[0]

    def model(self, name: str, inputs: list[ir.Value], outputs: list[ir.Value]) -> ir.Model:
        g = ir.Graph(
            inputs,
            outputs,
            nodes=self.nodes,
            initializers=self.inits,
            opset_imports={"": graphs.EXPORT_OPSET},
            name=name,
        )
        return ir.Model(g, ir_version=8, producer_name="unit test")


def _input(name: str, dtype: ir.DataType, shape: list) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))


DEEPSTACK = {
    "mask_input": "visual_pos_masks",
    "embeds_input": "deepstack_visual_embeds",
    "vision_output": "deepstack_features",
    "layers": 1,
    "rows_dim": "visual_tokens",
    "vision_layers": [0],
}


def vision_graph(deepstack: bool = False) -> ir.Model:
    """pixel_values [images, patches, PATCH_DIM] -> image_features [images * patches, HIDDEN].

    ``deepstack`` adds a ``deepstack_features`` [1, images * patches, HIDDEN] output (Qwen3-VL's
    intermediate vision features, which the decoder adds at the image positions).
    """
    b = _Builder(1)
    px = _input("pixel_values", FLOAT, ["images", PATCHES, PATCH_DIM])
    h = b.op("MatMul", [px, b.weight("vision.proj", PATCH_DIM, HIDDEN)], "vision.h")
    act = b.op("Relu", [h], "vision.act")
    h = b.op("MatMul", [act, b.weight("vision.out", HIDDEN, HIDDEN)], "vision.o")
    feats = b.op("Reshape", [h, b.const("vision.rows", np.array([-1, HIDDEN], np.int64))], "image_features")
    feats.dtype, feats.shape = FLOAT, ir.Shape(["image_tokens", HIDDEN])
    outputs = [feats]
    if deepstack:
        rows = b.const("vision.ds_rows", np.array([1, -1, HIDDEN], np.int64))
        ds = b.op("Reshape", [act, rows], DEEPSTACK["vision_output"])
        ds.dtype, ds.shape = FLOAT, ir.Shape([1, "image_tokens", HIDDEN])
        outputs.append(ds)
    return b.model("vision_encoder", [px], outputs)


def embed_graph() -> ir.Model:
    b = _Builder(2)
    ids = _input("input_ids", INT64, ["batch", "sequence"])
    out = b.op("Gather", [b.weight("embed.weight", VOCAB, HIDDEN), ids], "inputs_embeds", axis=0)
    out.dtype, out.shape = FLOAT, ir.Shape(["batch", "sequence", HIDDEN])
    return b.model("embed_tokens", [ids], [out])


def decoder_graph(
    layers: int = 3,
    skip_from_embeds: bool = False,
    past_values_in_layer: int | None = None,
    deepstack: bool = False,
) -> ir.Model:
    """A decoder of ``layers`` residual layers with a contiguous KV interface.

    Layer i: k = h Wk, v = h Wv; present = Concat(past, new) on the sequence axis; a = h Wq +
    sum(present key) * sum(present value) / (past length + 1) + mask term; h = h + tanh(a).
    The past length comes from the *shape* of layer 0's past key (as a traced causal mask's does),
    so later layer ranges read another range's input only for its shape.

    ``skip_from_embeds`` adds ``inputs_embeds`` to every layer's output as well (no single tensor
    then separates two layers); ``past_values_in_layer`` makes that layer read layer 0's past
    values (not only their shape); ``deepstack`` adds the deepstack inputs (a placeholder mask and
    feature rows) to the residual stream before layer 0.
    """
    b = _Builder(3)
    x = _input("inputs_embeds", FLOAT, ["batch", "sequence", HIDDEN])
    mask = _input("attention_mask", INT64, ["batch", "total_sequence"])
    past = {
        (i, kind): _input(tensor_names.past(i, kind), FLOAT, ["batch", "past_sequence", HIDDEN])
        for i in range(layers)
        for kind in tensor_names.KV_KINDS
    }
    shape = b.op("Shape", [past[(0, "key")]], "past_shape")
    length = b.op("Gather", [shape, b.const("one_index", np.array(1, np.int64))], "past_length", axis=0)
    length = b.op("Cast", [length], "past_length_f", to=int(FLOAT))
    denom = b.op("Add", [length, b.const("one_f", np.array(1.0, np.float32))], "denominator")
    valid = b.op("ReduceSum", [b.op("Cast", [mask], "mask_f", to=int(FLOAT))], "mask_sum", keepdims=0)
    mask_term = b.op("Mul", [valid, b.const("mask_scale", np.array(0.01, np.float32))], "mask_term")
    h = x
    extra: list[ir.Value] = []
    if deepstack:
        ds_mask = _input(DEEPSTACK["mask_input"], INT64, ["batch", "sequence"])
        ds_rows = _input(DEEPSTACK["embeds_input"], FLOAT, [1, DEEPSTACK["rows_dim"], HIDDEN])
        extra = [ds_mask, ds_rows]
        axes = b.const("ds_axes", np.array([0, 1], np.int64))
        rows = b.op("ReduceSum", [ds_rows, axes], "ds_sum", keepdims=0)
        at = b.op("Cast", [ds_mask], "ds_mask_f", to=int(FLOAT))
        at = b.op("Unsqueeze", [at, b.const("last", np.array([-1], np.int64))], "ds_at")
        h = b.op("Add", [h, b.op("Mul", [at, rows], "ds_term")], "ds_residual")
    presents = []
    axis = b.const("seq_axis", np.array([1], np.int64))
    for i in range(layers):
        p = f"layers.{i}."
        k = b.op("MatMul", [h, b.weight(p + "k", HIDDEN, HIDDEN)], p + "k_out")
        v = b.op("MatMul", [h, b.weight(p + "v", HIDDEN, HIDDEN)], p + "v_out")
        pk = b.op("Concat", [past[(i, "key")], k], tensor_names.present(i, "key"), axis=1)
        pv = b.op("Concat", [past[(i, "value")], v], tensor_names.present(i, "value"), axis=1)
        presents += [pk, pv]
        ctx = b.op(
            "Mul",
            [
                b.op("ReduceSum", [pk, axis], p + "k_mean", keepdims=1),
                b.op("ReduceSum", [pv, axis], p + "v_mean", keepdims=1),
            ],
            p + "ctx",
        )
        if past_values_in_layer == i:
            ctx = b.op(
                "Add",
                [ctx, b.op("ReduceSum", [past[(0, "value")], axis], p + "foreign", keepdims=1)],
                p + "ctx2",
            )
        a = b.op("MatMul", [h, b.weight(p + "q", HIDDEN, HIDDEN)], p + "q_out")
        a = b.op("Add", [a, b.op("Div", [ctx, denom], p + "ctx_scaled")], p + "attn")
        a = b.op("Add", [a, mask_term], p + "attn_masked")
        h = b.op("Add", [h, b.op("Tanh", [a], p + "act")], p + "residual")
        if skip_from_embeds:
            h = b.op("Add", [h, x], p + "skip")
    logits = b.op("MatMul", [h, b.weight("lm_head", HIDDEN, VOCAB)], tensor_names.LOGITS)
    logits.dtype, logits.shape = FLOAT, ir.Shape(["batch", "sequence", VOCAB])
    for pv in presents:
        pv.dtype, pv.shape = FLOAT, ir.Shape(["batch", "total_sequence", HIDDEN])
    inputs = [x, mask, *extra, *past.values()]
    return b.model("decoder", inputs, [logits, *presents])


MANIFEST = {
    "format_version": 1,
    "vlmc_version": "0.1.0",
    "history": [],
    "model": {
        "architecture": "Handmade",
        "config_hash": "sha256:0",
        "family": "llava",
        "source": "unit-test",
    },
    "pipeline": {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]},
    "graphs": {},
    "kv": {
        "block_size": None,
        "dtype": "float32",
        "head_dim": HIDDEN,
        "kv_heads": 1,
        "layers": 3,
        "layout": "contiguous",
    },
    "text": {
        "add_bos": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_size": HIDDEN,
        "image_marker": "<image>",
        "intermediate_size": HIDDEN,
        "max_positions": 64,
        "pad_token_id": 0,
        "position": "1d",
        "prompt_template": "{prompt}",
        "tokenizer": "bytes",
        "vocab_size": VOCAB,
    },
    "vision": {
        "feature_layer": -1,
        "has_cls_token": False,
        "hidden_size": HIDDEN,
        "image_size": [8, 8],
        "image_token_id": IMAGE_TOKEN,
        "patch_grid": [2, 2],
        "preprocess": {
            "crop_size": [8, 8],
            "kind": "clip",
            "mean": [0.5, 0.5, 0.5],
            "resample": "bicubic",
            "rescale_factor": 1 / 255,
            "resize_shortest_edge": 8,
            "std": [0.5, 0.5, 0.5],
        },
        "select_strategy": "default",
        "tokens_per_image": PATCHES,
    },
}


def package(directory: Path, layers: int = 3, deepstack: bool = False, **decoder_kw) -> Package:
    """A package of the three hand-built graphs, saved to ``directory`` and opened from there."""
    import copy

    manifest = copy.deepcopy(MANIFEST)
    manifest["kv"]["layers"] = layers
    if deepstack:
        manifest["text"]["deepstack"] = dict(DEEPSTACK)
    pkg = Package(manifest)
    pkg.set_graph("vision_encoder", vision_graph(deepstack), role="vision")
    pkg.set_graph("embed_tokens", embed_graph(), role="embed")
    pkg.set_graph("decoder", decoder_graph(layers, deepstack=deepstack, **decoder_kw), role="decoder")
    return Package.load(pkg.save(directory))


def decoder_feeds(
    layers: int, seed: int = 0, batch: int = 2, seq: int = 3, past: int = 2
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {
        "inputs_embeds": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
        "attention_mask": np.ones((batch, past + seq), np.int64),
    }
    feeds["attention_mask"][0, 0] = 0
    for i in range(layers):
        for kind in tensor_names.KV_KINDS:
            feeds[tensor_names.past(i, kind)] = rng.standard_normal((batch, past, HIDDEN)).astype(np.float32)
    return feeds


def run(model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of an IR model on onnxruntime (CPU), by name."""
    import onnxruntime as ort

    from vlmc import interop

    sess = ort.InferenceSession(interop.session_bytes(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    outs = sess.run(None, {n: feeds[n] for n in names})
    return dict(zip([o.name for o in sess.get_outputs()], outs))


@contextlib.contextmanager
def weight_reads(pkg: Package):
    """Count the weight loads (memory maps or file copies of an ``ExternalTensor``) inside the block.

    Every graph the package holds is released first, so a read inside the block has to load again.
    onnx-ir's ExternalTensor reaches its bytes only through ``_load`` (numpy / tobytes / __array__)
    and ``tofile``; both are wrapped to count, and still do their work.
    """
    for name in pkg.graph_names:
        if pkg.is_loaded(name):
            interop.release(v.const_value for v in pkg.model(name).graph.initializers.values())
    counts: list[str] = []
    load, tofile = ir.ExternalTensor._load, ir.ExternalTensor.tofile

    def counted_load(self):
        counts.append(self.name)
        return load(self)

    def counted_tofile(self, file):
        counts.append(self.name)
        return tofile(self, file)

    ir.ExternalTensor._load, ir.ExternalTensor.tofile = counted_load, counted_tofile
    try:
        yield counts
    finally:
        ir.ExternalTensor._load, ir.ExternalTensor.tofile = load, tofile


def external_tensors(model: ir.Model) -> dict[str, ir.ExternalTensor]:
    return {
        n: v.const_value
        for n, v in model.graph.initializers.items()
        if isinstance(v.const_value, ir.ExternalTensor)
    }
