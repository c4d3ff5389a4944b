"""Shared exporter machinery: tracing wrappers, torch.onnx export, and manifest facts.

Exporters split a transformers model into stage graphs with the interfaces in docs/architecture.md.
The decoder wrapper works for any causal LM whose forward takes ``inputs_embeds``,
``attention_mask``, ``position_ids`` and a transformers ``DynamicCache``; family modules only say
which submodules to use and which facts go into the manifest.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import warnings
from collections.abc import Sequence

import onnx
import torch

from vlmc import graphs as G
from vlmc import samples
from vlmc.package import Package

logger = logging.getLogger(__name__)

# Symbolic dimension names shared with the runtime, samples and backends.
BATCH, SEQ, PAST, TOTAL, IMAGES, PATCHES = (
    "batch",
    "sequence",
    "past_sequence",
    "total_sequence",
    "images",
    "patches",
)


def kv_names(layers: int) -> tuple[list[str], list[str]]:
    """Past and present KV tensor names in layer order (key then value)."""
    past = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    present = [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    return past, present


class DecoderWrapper(torch.nn.Module):
    """inputs_embeds, attention_mask, position_ids, past K/V... -> logits, present K/V...

    The cache is rebuilt from flat tensors inside forward, so the traced graph has plain tensor
    inputs and outputs with the standard names.
    """

    def __init__(self, text_model: torch.nn.Module, lm_head: torch.nn.Module, layers: int) -> None:
        super().__init__()
        self.text_model = text_model
        self.lm_head = lm_head
        self.layers = layers

    def forward(self, inputs_embeds, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.text_model.config)
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.text_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        logits = self.lm_head(out.last_hidden_state)
        present = []
        for layer in out.past_key_values.layers[: self.layers]:
            present += [layer.keys, layer.values]
        return (logits, *present)


class EmbedWrapper(torch.nn.Module):
    """input_ids -> inputs_embeds."""

    def __init__(self, embedding: torch.nn.Module) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, input_ids):
        return self.embedding(input_ids)


def export_graph(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
) -> onnx.ModelProto:
    """Trace a module with torch.onnx (TorchScript exporter, opset 17) and return the ModelProto.

    The TorchScript exporter is used because it is fast and keeps the dynamic axes we name; its
    deprecation warnings are silenced. Weights come back inline (we re-save with external data).
    """
    module.eval()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        path = os.path.join(tmp, "graph.onnx")
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink):
            torch.onnx.export(
                module,
                tuple(args),
                path,
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=G.EXPORT_OPSET,
                dynamo=False,
                do_constant_folding=True,
            )
        model = G.load(path)
    _name_unnamed_nodes(model)
    _inline_shared_small_constants(model)
    return model


def _inline_shared_small_constants(model: onnx.ModelProto, limit: int = 1 << 16) -> None:
    """Give small weights that the tracer shared through Identity nodes their own initializer.

    torch's exporter stores equal parameters once and feeds the copies through Identity (random
    tiny models have many identical zero biases). Quantizers and the Ascend lowering need a Gemm or
    MatMul bias to be an initializer, so small ones are materialized; large shared tensors keep the
    Identity so no weight bytes are duplicated.
    """
    inits = {t.name: t for t in model.graph.initializer}
    keep = []
    for node in model.graph.node:
        src = inits.get(node.input[0]) if node.op_type == "Identity" and node.input else None
        if src is not None and len(src.raw_data) <= limit:
            copy = onnx.TensorProto()
            copy.CopyFrom(src)
            copy.name = node.output[0]
            model.graph.initializer.append(copy)
        else:
            keep.append(node)
    if len(keep) != len(model.graph.node):
        del model.graph.node[:]
        model.graph.node.extend(keep)


def _name_unnamed_nodes(model: onnx.ModelProto) -> None:
    # Node names are how users and backends refer to nodes (keep_dtype lists, precheck messages).
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)


def decoder_axes(layers: int, mrope: bool = False) -> dict[str, dict[int, str]]:
    past, present = kv_names(layers)
    axes = {
        "inputs_embeds": {0: BATCH, 1: SEQ},
        "attention_mask": {0: BATCH, 1: TOTAL},
        "position_ids": {1: BATCH, 2: SEQ} if mrope else {0: BATCH, 1: SEQ},
        "logits": {0: BATCH, 1: SEQ},
    }
    axes.update({n: {0: BATCH, 2: PAST} for n in past})
    axes.update({n: {0: BATCH, 2: TOTAL} for n in present})
    return axes


def export_decoder(
    pkg: Package,
    text_model,
    lm_head,
    layers: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    position_ids_fn=None,
    mrope: bool = False,
    dtype=torch.float32,
) -> None:
    """Export the shared decoder graph and store its sample inputs."""
    pkg.release()  # a staged package (vlmc build) keeps earlier stages on disk while the largest one traces
    g = torch.Generator().manual_seed(0)
    batch, seq, past_len = 2, 5, 3
    embeds = torch.randn(batch, seq, hidden, generator=g, dtype=dtype)
    mask = torch.ones(batch, past_len + seq, dtype=torch.int64)
    pos = torch.arange(past_len, past_len + seq).unsqueeze(0).expand(batch, seq)
    if mrope:
        pos = pos.unsqueeze(0).expand(3, batch, seq)
    past = [
        torch.randn(batch, kv_heads, past_len, head_dim, generator=g, dtype=dtype) for _ in range(2 * layers)
    ]
    past_names, present_names = kv_names(layers)
    names = ["inputs_embeds", "attention_mask", "position_ids", *past_names]
    model = export_graph(
        DecoderWrapper(text_model, lm_head, layers),
        [embeds, mask, pos.contiguous(), *past],
        names,
        ["logits", *present_names],
        decoder_axes(layers, mrope),
    )
    pkg.set_graph("decoder", model, role="decoder", precision="fp32")
    samples.store(
        pkg, "decoder", {n: t.numpy() for n, t in zip(names, [embeds, mask, pos.contiguous(), *past])}
    )
    del model
    pkg.release("decoder")


def export_embed(pkg: Package, embedding, vocab: int) -> None:
    pkg.release()  # see export_decoder
    ids = torch.arange(10, dtype=torch.int64).reshape(2, 5) % vocab
    model = export_graph(
        EmbedWrapper(embedding),
        [ids],
        ["input_ids"],
        ["inputs_embeds"],
        {"input_ids": {0: BATCH, 1: SEQ}, "inputs_embeds": {0: BATCH, 1: SEQ}},
    )
    pkg.set_graph("embed_tokens", model, role="embed", precision="fp32")
    samples.store(pkg, "embed_tokens", {"input_ids": ids.numpy()})
