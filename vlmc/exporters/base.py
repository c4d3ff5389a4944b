"""Shared exporter machinery: tracing wrappers, torch.onnx export, and manifest facts.

Exporters split a transformers model into stage graphs with the interfaces in docs/architecture.md.
The decoder wrapper works for any causal LM whose forward takes ``inputs_embeds``,
``attention_mask``, ``position_ids`` and a transformers ``DynamicCache``; family modules only say
which submodules to use and which facts go into the manifest.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import tempfile
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir
import torch

from vlmc import graphs, interop, interrupts, samples
from vlmc.exporters import streaming
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
    """inputs_embeds, attention_mask, position_ids, [extra inputs...], past K/V... -> logits, present K/V...

    The cache is rebuilt from flat tensors inside forward, so the traced graph has plain tensor
    inputs and outputs with the standard names. The cache is handed to the text model as ``cache=``
    (transformers 5 deprecates ``past_key_values=`` and removes it in 5.40).

    - ``extra_inputs`` names graph inputs that come after position_ids (e.g. Gemma3's
      ``token_type_ids``); ``text_kwargs(text_model, inputs_embeds, attention_mask, position_ids, cache,
      **extras)`` turns them (and the 2-D mask) into the text model's keyword arguments, e.g. a mask
      mapping per attention type. Without it the text model gets ``attention_mask`` as given.
    - The cache is a ``DynamicCache`` without the model config, so every layer keeps its whole past,
      sliding-window layers too: the window is applied by the layer's mask (transformers builds it from
      ``config.sliding_window`` for ``sliding_attention`` layers), which gives the same attention as a
      truncated window cache; the graph's KV interface stays one shape per layer.
    - ``softcap`` is the text config's ``final_logit_softcapping`` (Gemma), applied to the logits as the
      conditional-generation head does.
    """

    def __init__(
        self,
        text_model: torch.nn.Module,
        lm_head: torch.nn.Module,
        layers: int,
        extra_inputs: Sequence[str] = (),
        text_kwargs=None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.text_model = text_model
        self.lm_head = lm_head
        self.layers = layers
        self.extra_inputs = tuple(extra_inputs)
        self.text_kwargs = text_kwargs
        self.softcap = softcap

    def forward(self, inputs_embeds, attention_mask, position_ids, *rest):
        from transformers import DynamicCache

        n = len(self.extra_inputs)
        extras, past = dict(zip(self.extra_inputs, rest[:n])), rest[n:]
        cache = DynamicCache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        if self.text_kwargs is not None:
            kwargs = self.text_kwargs(
                self.text_model, inputs_embeds, attention_mask, position_ids, cache, **extras
            )
        else:
            kwargs = {"attention_mask": attention_mask}
        out = self.text_model(
            inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache, use_cache=True, **kwargs
        )
        logits = self.lm_head(out.last_hidden_state)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        present = []
        # The cache was updated in place by the layers (this step's K/V appended to each past).
        for layer in cache.layers[: self.layers]:
            present += [layer.keys, layer.values]
        return (logits, *present)


@dataclass(frozen=True)
class DecoderInput:
    """An extra decoder graph input beyond embeds/mask/positions/KV (see DecoderWrapper.extra_inputs).

    ``rule`` names how the runtime fills it (vlmc/runtime/extras.py: e.g. ``image_tokens``, 1 on image
    placeholders at prefill and 0 for decoded tokens); it is written to the manifest's
    ``text.decoder_inputs`` so runtime and passes need no family knowledge. ``sample(batch, seq)`` makes
    the tracing sample; ``axes`` are its symbolic dims.
    """

    name: str
    rule: str
    sample: object  # Callable[[int, int], torch.Tensor]
    axes: dict = field(default_factory=lambda: {0: BATCH, 1: SEQ})


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
    path: Path,
    edit=None,
) -> ir.Model:
    """Trace a module with torch.onnx (TorchScript exporter, opset 17) into ``path`` + ``path.data``.

    ``edit(model)``, if given, may adjust the graph's structure (a ModelProto) before it is written.
    Returns the written graph as IR without its weights (for reading facts off its structure).

    The TorchScript exporter is used because it is fast and keeps the dynamic axes we name. Its own
    writer serializes every weight into one protobuf in memory (and the result would have to be
    loaded back to move the weights to external data), which held the model's weights three times
    over at once. Here the exporter writes only the graph: parameters are kept out of its
    serialization (see :func:`_weights_out_of_proto`) and streamed from the torch tensors to the
    data file one at a time, each hashed as it is written. Linear weights are laid out as [in, out]
    before tracing (:func:`_linear_weights_transposed`) so that torch's constant folding does not
    materialize a transposed copy of each of them.

    Layer stacks the source loaded at reduced depth (vlmc/exporters/streaming.py) are grown to their
    full depth after tracing (:func:`streaming.stitch`): their parameters are kept out of torch's
    serialization like the large ones, whatever their size, so that each layer's weights are its
    own initializers, and the added layers' weights are streamed from the source checkpoint.
    """
    module.eval()
    path = Path(path)
    large: dict[str, torch.Tensor] = {}
    stacks = {
        name: (streaming.stack_of(m), len(m)) for name, m in module.named_modules() if streaming.stack_of(m)
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        warnings.catch_warnings(),
        torch.no_grad(),
        _linear_weights_transposed(module),
        _weights_out_of_proto(large, tuple(f"{name}." for name in stacks)),
    ):
        warnings.simplefilter("ignore")
        tmp_path = os.path.join(tmp, "graph.onnx")
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink):
            torch.onnx.export(
                module,
                tuple(args),
                tmp_path,
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=graphs.EXPORT_OPSET,
                dynamo=False,
                do_constant_folding=True,
            )
        model = interop.exported(tmp_path)  # the graph and small constants only, its nodes named
        copies = []
        for name, (stack, traced) in stacks.items():
            copies += streaming.stitch(model, name, stack, traced)
        if edit is not None:
            edit(model)
        _write_with_weights(model, large, path, copies)
    return interop.from_proto(model)


# Parameters larger than this are streamed to the data file by vlmc instead of serialized by torch.
_STREAM_BYTES = 1 << 16


@contextlib.contextmanager
def _weights_out_of_proto(large: dict[str, torch.Tensor], stream_prefixes: tuple[str, ...] = ()):
    """Keep large parameters out of every protobuf the TorchScript exporter builds; collect them in ``large``.

    - The exporter hands its final name -> tensor map to ``_jit_pass_onnx_deduplicate_initializers``
      and serializes whatever that returns as initializers; parameters it does not return stay
      graph inputs, which :func:`_write_with_weights` turns into external initializers.
    - Its ONNX shape inference (whole graph, and node by node while converting) serializes the
      parameters it is given into a ModelProto: for a 525 MB embedding table that was a 1 GB
      transient. Weights are never shape constants, so the large ones are left out of those calls;
      their shapes still come from the graph's typed inputs.

    These three entry points of torch 2.13's exporter (pinned in constraints.txt) are the narrowest
    hooks there are; if torch renames one, the export fails loudly here rather than silently holding
    every weight in memory again. A test compares the result with torch.onnx.export's own output.
    docs/architecture.md ("Which torch exporter, and why") says where torch calls each one, why no
    public switch does the same, and what would replace them (the dynamo exporter, measured there).

    Parameters whose names start with one of ``stream_prefixes`` (the layer stacks being stitched)
    are collected whatever their size.
    """
    from torch import _C

    def streamed(k: str, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() > _STREAM_BYTES or k.startswith(stream_prefixes)

    def small(params: dict) -> dict:
        return {k: t for k, t in params.items() if not streamed(k, t)}

    def dedupe(real):
        # Large parameters skip torch's deduplication: it compares tensors by value, which made
        # contiguous copies of the transposed weight views (a 0.5 GB transient at LLaVA-1.5 widths).
        # A weight shared by two modules is one Parameter, so one graph input, without it.
        def split(graph, params, training):
            large.update({k: t for k, t in params.items() if streamed(k, t)})
            return real(graph, small(params), training)

        return split

    def shapes(real):
        return lambda target, params, opset: real(target, small(params), opset)

    hooks = {
        "_jit_pass_onnx_deduplicate_initializers": dedupe,
        "_jit_pass_onnx_graph_shape_type_inference": shapes,
        "_jit_pass_onnx_node_shape_type_inference": shapes,
    }
    originals = {}
    for name, wrap in hooks.items():
        real = getattr(_C, name, None)
        if real is None:
            raise RuntimeError(
                f"torch {torch.__version__} has no {name}; vlmc's streaming export needs torch 2.13"
            )
        originals[name] = real
        setattr(_C, name, wrap(real))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(_C, name, real)


@contextlib.contextmanager
def _linear_weights_transposed(module: torch.nn.Module):
    """While tracing, hand every Linear's weight to the tracer as a transposed *view*, [in, out].

    torch exports ``Linear`` on 3-D inputs as ``MatMul(x, Transpose(W))`` and its constant folding
    then materializes ``W^T`` for every layer at once: a second copy of nearly all decoder weights,
    on top of the model's own. Here the forward multiplies by a parameter that is a view of ``W``
    transposed (no copy), so nothing is folded and the exported graph is the same
    ``MatMul(x, W^T) + b`` (2-D inputs: ``Gemm(x, W^T, b)``); the streaming writer makes each
    view contiguous one tensor at a time as it writes it. The original parameters are put back
    afterwards, so the model is unchanged. Tied weights (one parameter used by several modules)
    are left alone.
    """
    counts: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
    linears = [
        m
        for m in module.modules()
        if type(m) is torch.nn.Linear and counts.get(id(m.weight), 0) == 1 and "forward" not in vars(m)
    ]
    originals = []
    for m in linears:
        w = m._parameters.pop("weight")
        originals.append(w)
        m.__dict__["weight"] = w.detach()  # still readable (dtype, shape), but not a traced parameter
        m.register_parameter("weight_t", torch.nn.Parameter(w.detach().t(), requires_grad=False))
        m.forward = _transposed_forward(m)
    try:
        yield
    finally:
        for m, w in zip(linears, originals):
            del m.forward
            del m._parameters["weight_t"]
            del m.__dict__["weight"]
            m.weight = w


def _transposed_forward(m: torch.nn.Linear):
    def forward(x):
        if x.dim() == 2 and m.bias is not None:
            return torch.addmm(m.bias, x, m.weight_t)
        y = torch.matmul(x, m.weight_t)
        return y + m.bias if m.bias is not None else y

    return forward


# Views up to this size are transposed whole, into the writer's reused scratch buffer (see _chunks).
_WHOLE_TRANSPOSE_BYTES = 256 << 20
# Bytes per write (and per converted block), and how many converted blocks may be in flight.
_CHUNK_BYTES = 32 << 20
_CHUNK_BUFFERS = 3


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, in place (bf16 has no numpy dtype: read as bytes)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _DataWriter:
    """Writes a graph's data file and hashes each tensor's bytes behind the thread that prepares them.

    The caller (:func:`_write_with_weights`) transposes and converts the next weight while the
    previous one's blocks are written (one thread) and hashed (another); file writes, sha256 and
    torch's copies all release the GIL, so reading the checkpoint, converting, hashing and writing
    overlap instead of adding up. Converted blocks live in a few buffers of ``_CHUNK_BYTES`` that are
    reused once written and hashed, and a transposed weight in one scratch buffer reused for the
    next: after the first weights, no memory is allocated per tensor. (Fresh allocations were the
    slowest part of the writer on a machine whose page cache is full of the data being written:
    each one had to reclaim pages first.) Memory in flight: the scratch (the largest transposed
    weight that is not the embedding or head) plus ``_CHUNK_BUFFERS`` blocks. Bounding the file's
    dirty pages (sync_file_range every 64 MB, with or without dropping them from the page cache)
    was measured at LLaVA-1.5-7B widths and changed nothing, so writeback is left to the kernel.
    """

    def __init__(self, f) -> None:
        self._f = f
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="vlmc-write")
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="vlmc-hash")
        self._pending: collections.deque = collections.deque()  # (write, hash, buffer to free)
        self._free: list[torch.Tensor] = []
        self._buffers = 0
        self._scratch: torch.Tensor | None = None
        self._scratch_queued = False  # blocks of the scratch itself are queued for writing
        self.offset = 0

    def __enter__(self) -> _DataWriter:
        return self

    def __exit__(self, *exc) -> None:
        failed = exc[0] is not None  # then what is queued is dropped: the file is not used
        try:
            if not failed:
                self.drain()
        finally:
            self._writer.shutdown(wait=True, cancel_futures=failed)
            self._hasher.shutdown(wait=True, cancel_futures=failed)
            self._scratch = None
            self._free.clear()

    def buffer(self, nbytes: int = 0) -> torch.Tensor | None:
        """A block buffer (uint8, ``_CHUNK_BYTES``) no write or hash still reads; None if ``nbytes``
        is more than a block (the caller makes its own)."""
        if nbytes > _CHUNK_BYTES:
            return None
        while not self._free and self._buffers >= _CHUNK_BUFFERS:
            self._retire()
        if self._free:
            return self._free.pop()
        self._buffers += 1
        return torch.empty(_CHUNK_BYTES, dtype=torch.uint8)

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A contiguous buffer shaped and typed like ``like``, reused (after what reads it is written).

        Only blocks queued straight from the scratch (a weight kept in its dtype, see
        :meth:`queue_scratch`) make it wait for the writer: a converted weight's blocks are copies,
        so the next weight is read and transposed while the last one's blocks are still being
        written. (With a wait before every transpose, reading the checkpoint and writing the graph
        took turns: at LLaVA-1.5-7B the converting thread waited 37 of the decoder's 92 s for the
        writer, and `vlmc export` took 104 s against 91 s without the wait, medians of 2 alternating
        runs.)
        """
        if self._scratch_queued:
            self.drain()
            self._scratch_queued = False
        n = like.numel() * like.element_size()
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = None
            self._scratch = torch.empty(n, dtype=torch.uint8)
        return self._scratch[:n].view(like.dtype).view(like.shape)

    def queue_scratch(self) -> None:
        """The scratch's own bytes are about to be queued: the next :meth:`scratch` waits for them."""
        self._scratch_queued = True

    def _retire(self) -> None:
        write, digest, buf = self._pending.popleft()
        write.result()
        if digest is not None:
            digest.result()
        if buf is not None:
            self._free.append(buf)

    def drain(self) -> None:
        while self._pending:
            self._retire()

    def _write(self, data: memoryview) -> None:
        interrupts.check()  # in the writer thread: a recorded Ctrl-C fails this block's future
        self._f.write(data)

    def _submit(self, data: memoryview, h, buf: torch.Tensor | None) -> None:
        interrupts.check()  # between two blocks of a weight
        write = self._writer.submit(self._write, data)
        digest = self._hasher.submit(h.update, data) if h is not None else None
        self._pending.append((write, digest, buf))
        self.offset += len(data)

    def put(self, dtype: int, dims: list[int], chunks):
        """Append one tensor's blocks ``(bytes, buffer or None)`` 64-byte aligned.

        Returns ``(offset, length, digest)``, ``digest`` a future of its :func:`interop.tensor_hash`.
        """
        pad = (-self.offset) % 64
        if pad:
            self._submit(memoryview(b"\0" * pad), None, None)
        start = self.offset
        h = interop.digest_start(dtype, dims)
        for data, buf in chunks:
            self._submit(data, h, buf)
        return start, self.offset - start, self._hasher.submit(h.hexdigest)


def _chunks(tensor: torch.Tensor, dtype: torch.dtype, out: _DataWriter | None = None):
    """A tensor's bytes in C order as ``dtype``, as ``(memoryview, buffer)`` blocks for ``out``.

    A contiguous tensor in its dtype is one block straight from its memory (buffer None). A view (a
    transposed Linear weight) of up to ``_WHOLE_TRANSPOSE_BYTES`` is transposed whole in its own
    dtype into the writer's scratch (torch's cache-blocked 2-D transpose; a bf16 checkpoint weight
    is transposed in bf16, half the bytes), then converted block by block into the writer's block
    buffers; a larger view (the LM head) is gathered a block of rows at a time into them. Values
    are exactly ``tensor.to(dtype)`` (torch's conversion; bf16 -> fp32 is exact). Without ``out``
    (small tensors, inlined in the graph), blocks are fresh tensors.
    """
    src = tensor
    nbytes = src.numel() * dtype.itemsize
    if src.dim() == 0 or (src.is_contiguous() and src.dtype == dtype):
        yield _as_bytes(src.contiguous().to(dtype)), None
        return
    if out is None:
        yield _as_bytes(src.to(dtype).contiguous()), None
        return
    if not src.is_contiguous() and src.numel() * src.element_size() <= _WHOLE_TRANSPOSE_BYTES:
        # The transpose is only fast as one whole 2-D copy (torch's blocked copy_same_type_transpose_
        # needs the full matrix); a block of rows of a transposed view is a strided gather, 2x slower.
        src = out.scratch(src).copy_(src)
    if src.is_contiguous():
        if src.dtype == dtype:  # a transposed weight in its own dtype: write the scratch as it is
            out.queue_scratch()
            flat = _as_bytes(src)
            for a in range(0, nbytes, _CHUNK_BYTES):
                yield flat[a : a + _CHUNK_BYTES], None
            return
        flat = src.reshape(-1)
        step = _CHUNK_BYTES // dtype.itemsize
        for a in range(0, flat.numel(), step):
            piece = flat[a : a + step]
            buf = out.buffer()
            block = buf[: piece.numel() * dtype.itemsize].view(dtype).copy_(piece)
            yield _as_bytes(block), buf
        return
    row_bytes = max(1, src[0].numel() * dtype.itemsize)
    step = max(1, _CHUNK_BYTES // row_bytes)
    for r in range(0, src.shape[0], step):
        piece = src[r : r + step]
        n = piece.numel() * dtype.itemsize
        buf = out.buffer(n)
        room = buf if buf is not None else torch.empty(n, dtype=torch.uint8)  # a row over a block
        block = room[:n].view(dtype).view(piece.shape).copy_(piece)
        yield _as_bytes(block), buf


def _write_with_weights(
    model: onnx.ModelProto,
    large: dict[str, torch.Tensor],
    path: Path,
    copies: Sequence[streaming.Copy] = (),
) -> None:
    """Turn the graph inputs that stand for parameters into initializers whose bytes go to ``path.data``.

    Small initializers torch serialized go to the data file too (every tensor of 1 KiB or more is
    external, as in any saved package). Each tensor is written from its own memory and hashed while
    it is written, so the pass manager never reads it again to fingerprint it. ``copies`` are the
    stitched layers' weights: each is read from the source checkpoint, converted to the traced
    tensor's dtype and layout, written and dropped before the next.
    """
    templates = {c.template: large[c.template] for c in copies}
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = path.name + ".data"
    g = model.graph
    params = [v for v in g.input if v.name in large]
    elem_types = {v.name: v.type.tensor_type.elem_type for v in params}
    keep = [v for v in g.input if v.name not in large]
    del g.input[:]
    g.input.extend(keep)
    # torch also described the parameters in value_info; initializers carry their own type
    infos = [v for v in g.value_info if v.name not in large]
    del g.value_info[:]
    g.value_info.extend(infos)
    written: list[tuple[int, int, object]] = []  # (offset, length, digest future)
    with open(path.parent / data_name, "wb") as f, _DataWriter(f) as out:

        def put(t: onnx.TensorProto, chunks) -> None:
            offset, n, digest = out.put(t.data_type, list(t.dims), chunks)
            written.append((offset, n, digest))
            interop.point_at(t, data_name, offset, n)

        for t in g.initializer:
            if t.HasField("raw_data") and len(t.raw_data) >= interop.EXTERNAL_DATA_THRESHOLD:
                raw = t.raw_data
                t.ClearField("raw_data")
                put(t, [(memoryview(raw), None)])

        def add(name: str, elem_type: int, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
            t = g.initializer.add()
            t.name = name
            t.data_type = elem_type
            t.dims.extend(tensor.shape)
            dtype = dtype or tensor.dtype
            if tensor.numel() * dtype.itemsize < interop.EXTERNAL_DATA_THRESHOLD:
                t.raw_data = b"".join(bytes(c) for c, _ in _chunks(tensor, dtype))  # small: inline, as saved
            else:
                put(t, _chunks(tensor, dtype, out))

        for vi in params:
            tensor = large.pop(vi.name).detach()
            add(vi.name, vi.type.tensor_type.elem_type, tensor)
            del tensor
        for c in copies:
            tmpl = templates[c.template]
            if c.key is None:  # a buffer the checkpoint does not hold: computed alike in every layer
                tensor = tmpl.detach()
            else:
                tensor = c.stack.checkpoint.tensor(c.key)  # in the checkpoint's dtype
                tensor = tensor.t() if c.transposed else tensor
            if tuple(tensor.shape) != tuple(tmpl.shape):
                raise streaming.StitchError(
                    f"{c.key}: shape {tuple(tensor.shape)}, layer template {tuple(tmpl.shape)}"
                )
            add(c.name, elem_types[c.template], tensor, dtype=tmpl.dtype)
            del tensor
    hashes = [(offset, n, digest.result()) for offset, n, digest in written]
    interop.save_exported(model, path)
    interop.remember_hashes(path.parent / data_name, hashes)


def export_stage(
    pkg: Package,
    name: str,
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
    role: str,
    edit=None,
) -> ir.Model:
    """Export one stage graph into the package's scratch directory and add it as ``name`` (fp32).

    Returns the graph as IR without its weights, for exporters that read facts off its structure.
    """
    path = pkg.scratch_path(name)
    model = export_graph(module, args, input_names, output_names, dynamic_axes, path, edit=edit)
    pkg.set_graph_file(name, path, role=role, precision="fp32")
    return model


def export_square_vision(
    pkg: Package, module: torch.nn.Module, size: int, output: str
) -> tuple[ir.Model, torch.Tensor]:
    """Export a fixed-size ViT stage as ``vision_encoder`` from two seeded random ``size``² images, and
    store them as its samples. Returns the graph (as :func:`export_stage`) and the pixels."""
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    graph = export_stage(
        pkg,
        "vision_encoder",
        module,
        [pixels],
        ["pixel_values"],
        [output],
        {"pixel_values": {0: IMAGES}, output: {0: IMAGES}},
        role="vision",
    )
    samples.store(pkg, "vision_encoder", {"pixel_values": pixels.numpy()})
    return graph, pixels


def decoder_axes(
    layers: int, mrope: bool = False, position_axes: int | None = None, extra_inputs: Sequence = ()
) -> dict[str, dict[int, str]]:
    """Dynamic axes of the decoder graph. Positions are [batch, seq] (1-D RoPE) or, with
    ``position_axes`` (``mrope``: 3), [axes, batch, seq] (M-RoPE, interleaved M-RoPE)."""
    past, present = kv_names(layers)
    axes_n = position_axes if position_axes is not None else (3 if mrope else None)
    axes = {
        "inputs_embeds": {0: BATCH, 1: SEQ},
        "attention_mask": {0: BATCH, 1: TOTAL},
        "position_ids": {1: BATCH, 2: SEQ} if axes_n else {0: BATCH, 1: SEQ},
        "logits": {0: BATCH, 1: SEQ},
    }
    axes.update({x.name: dict(x.axes) for x in extra_inputs})
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
    position_axes: int | None = None,
    extra_inputs: Sequence[DecoderInput] = (),
    text_kwargs=None,
    softcap: float | None = None,
) -> None:
    """Export the shared decoder graph and store its sample inputs.

    Graph inputs: ``inputs_embeds``, ``attention_mask``, ``position_ids`` ([batch, seq], or
    [position_axes, batch, seq]; ``mrope=True`` is ``position_axes=3``), each of ``extra_inputs`` in
    order, then ``past_key_values.{i}.key/value``. See DecoderWrapper for ``text_kwargs``/``softcap``.

    A text model whose layer stack the source cut for streaming (vlmc/exporters/streaming.py) is
    traced at that depth and stitched to ``layers``; its samples are for the full graph.
    """
    traced = layers
    for m in text_model.modules():
        if streaming.stack_of(m) is not None:
            traced = len(m)
            break
    g = torch.Generator().manual_seed(0)
    batch, seq, past_len = 2, 5, 3
    embeds = torch.randn(batch, seq, hidden, generator=g, dtype=dtype)
    mask = torch.ones(batch, past_len + seq, dtype=torch.int64)
    pos = torch.arange(past_len, past_len + seq).unsqueeze(0).expand(batch, seq)
    axes_n = position_axes if position_axes is not None else (3 if mrope else None)
    if axes_n:
        pos = pos.unsqueeze(0).expand(axes_n, batch, seq)
    extras = [x.sample(batch, seq) for x in extra_inputs]
    past = [
        torch.randn(batch, kv_heads, past_len, head_dim, generator=g, dtype=dtype) for _ in range(2 * layers)
    ]
    past_names, present_names = kv_names(layers)
    extra_names = [x.name for x in extra_inputs]
    names = ["inputs_embeds", "attention_mask", "position_ids", *extra_names, *past_names]
    args = [embeds, mask, pos.contiguous(), *extras, *past]
    _, traced_present = kv_names(traced)
    head = 3 + len(extra_names)
    export_stage(
        pkg,
        "decoder",
        DecoderWrapper(text_model, lm_head, traced, extra_names, text_kwargs, softcap),
        args[: head + 2 * traced],
        names[: head + 2 * traced],
        ["logits", *traced_present],
        decoder_axes(traced, position_axes=axes_n, extra_inputs=extra_inputs),
        role="decoder",
    )
    samples.store(pkg, "decoder", {n: t.numpy() for n, t in zip(names, args)})


def export_embed(pkg: Package, embedding, vocab: int) -> None:
    ids = torch.arange(10, dtype=torch.int64).reshape(2, 5) % vocab
    export_stage(
        pkg,
        "embed_tokens",
        EmbedWrapper(embedding),
        [ids],
        ["input_ids"],
        ["inputs_embeds"],
        {"input_ids": {0: BATCH, 1: SEQ}, "inputs_embeds": {0: BATCH, 1: SEQ}},
        role="embed",
    )
    samples.store(pkg, "embed_tokens", {"input_ids": ids.numpy()})
