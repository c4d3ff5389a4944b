"""Device-memory budget: weights, KV per token/block, image token cost and activation headroom -> what fits.

Pure arithmetic over a :class:`Spec`, which comes from a package (weight bytes read from its graphs,
facts from vlmc.json) or from a model description without weights: a Hugging Face config.json of a
family vlmc exports (parameters counted on the meta device) or a neutral sizing spec (JSON/YAML
with ``"vlmc_spec": 1``, for models whose code is not in transformers). See docs/paged_kv.md.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vlmc import exporters
from vlmc.errors import VlmcError
from vlmc.graphs import initializer_bytes

logger = logging.getLogger(__name__)

# Bytes per weight element by manifest precision ("mixed" is counted as fp16, its usual bulk).
WEIGHT_BYTES = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "mixed": 2.0,
    "int8": 1.0,
    "int8_weight_only": 1.0,
    "int4_weight_only": 0.5,
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
# Blocks every paged pool holds beyond its sequences' (block 0, never handed out).
RESERVED_BLOCKS = 1
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int | float) -> int:
    """'16GiB' -> 17179869184, '16GB' -> 16000000000, plain numbers are bytes.

    Raises:
        VlmcError: the text is not a number with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS:
        raise VlmcError(f"cannot read size {text!r}; write e.g. 16GiB (2^30 bytes) or 16GB (10^9 bytes)")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def fmt_bytes(n: float) -> str:
    """Bytes as GiB/MiB/KiB with the decimal GB alongside for large values."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n >= 2**30:
        return f"{sign}{n / 2**30:.2f} GiB ({sign}{n / 1e9:.2f} GB)"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.1f} {unit}"
    return f"{sign}{int(n)} B"


@dataclass
class GraphWeights:
    name: str
    role: str
    precision: str
    params: int | None  # None when the bytes were read from a graph
    bytes: int


@dataclass
class Spec:
    """What planning needs to know about a model; every field is a plain number or string."""

    name: str
    graphs: list[GraphWeights]
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    tokens_per_image: int
    tokens_per_image_unpruned: int
    max_positions: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    act_dtype: str = "float16"
    block_size: int | None = None  # set for paged packages
    vision: dict = field(default_factory=dict)  # patches, width, intermediate, heads (activation estimate)
    vision_rows_per_image: int = 1  # vision-graph rows one image becomes (tiles of a tiled family)
    count_note: str | None = None  # how tokens_per_image was counted when it depends on the image size

    @property
    def weight_bytes(self) -> int:
        return sum(g.bytes for g in self.graphs)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]


@dataclass
class Budget:
    """The answer for one device and one request mix (all sizes in bytes)."""

    spec: str
    device_memory: int
    cards: int
    weights: list[dict]
    weight_bytes: int
    kv_bytes_per_token: int
    block_size: int
    kv_bytes_per_block: int
    images: int
    tokens_per_image: int
    tokens_per_image_unpruned: int
    image_tokens: int
    text_tokens: int
    sequence_tokens: int
    batch: int
    activation_bytes: int
    reserve_bytes: int
    free_for_kv: int
    max_context: int
    paged_reservation: int
    contiguous_reservation: int
    paged_saving: int
    fits_paged: bool
    fits_contiguous: bool
    max_sequences_paged: int
    max_sequences_contiguous: int
    max_context_one_sequence: int
    paged_step_bytes: int = 0  # transient of one paged decode step of the batch (see paged_step_bytes())
    notes: list[str] = field(default_factory=list)
    tensor_parallel: dict | None = None  # per-card memory under the tensor_parallel pass's split (--tp)

    def to_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[list[str]]:
        """Label/value rows for a table."""
        w = [
            [f"weights: {g['name']} ({g['role']}, {g['precision']})", fmt_bytes(g["bytes"])]
            for g in self.weights
        ]
        prune = (
            f" (pruned from {self.tokens_per_image_unpruned})"
            if self.tokens_per_image != self.tokens_per_image_unpruned
            else ""
        )
        return [
            [
                "device memory",
                f"{fmt_bytes(self.device_memory)}" + (f" x {self.cards} cards" if self.cards > 1 else ""),
            ],
            *w,
            ["weights total", fmt_bytes(self.weight_bytes)],
            ["KV per token", fmt_bytes(self.kv_bytes_per_token)],
            [f"KV per block ({self.block_size} tokens)", fmt_bytes(self.kv_bytes_per_block)],
            ["image tokens", f"{self.images} x {self.tokens_per_image}{prune} = {self.image_tokens}"],
            [
                "tokens per sequence",
                f"{self.image_tokens} image + {self.text_tokens} text = {self.sequence_tokens}",
            ],
            ["activation headroom (prefill peak)", fmt_bytes(self.activation_bytes)],
            ["runtime reserve", fmt_bytes(self.reserve_bytes)],
            ["left for KV", fmt_bytes(self.free_for_kv)],
            [f"paged KV for {self.batch} sequence(s)", fmt_bytes(self.paged_reservation)],
            [
                f"contiguous KV for {self.batch} (worst case {self.max_context} tokens each)",
                fmt_bytes(self.contiguous_reservation),
            ],
            ["paged saves", fmt_bytes(self.paged_saving)],
            [
                "fits (paged / contiguous)",
                f"{'yes' if self.fits_paged else 'NO'} / {'yes' if self.fits_contiguous else 'NO'}",
            ],
            [
                "max concurrent sequences (paged / contiguous)",
                f"{self.max_sequences_paged} / {self.max_sequences_contiguous}",
            ],
            ["max context of one sequence", str(self.max_context_one_sequence)],
            ["paged decode step, transient (one layer's gathered past)", fmt_bytes(self.paged_step_bytes)],
            *self._tp_rows(),
        ]

    def _tp_rows(self) -> list[list[str]]:
        t = self.tensor_parallel
        if not t:
            return []
        n = t["size"]
        return [
            [
                f"TP={n}: weights per card (replicated + 1/{n} of the layers)",
                f"{fmt_bytes(t['replicated_bytes'])} + {fmt_bytes(t['sharded_bytes'])} = {fmt_bytes(t['weight_bytes'])}",
            ],
            [
                f"TP={n}: KV per token per card ({t['kv_heads_per_card']} KV head(s), {t['kv']})",
                fmt_bytes(t["kv_bytes_per_token"]),
            ],
            [
                f"TP={n}: per card, paged KV for {self.batch} sequence(s) + headroom + reserve",
                fmt_bytes(t["paged_total"]),
            ],
            [
                f"TP={n}: per card, contiguous KV (worst case) + headroom + reserve",
                fmt_bytes(t["contiguous_total"]),
            ],
            [
                f"TP={n}: fits one card (paged / contiguous)",
                f"{'yes' if t['fits_paged'] else 'NO'} / {'yes' if t['fits_contiguous'] else 'NO'}",
            ],
        ]


def fit(
    spec: Spec,
    device_memory: int | str,
    images: int = 1,
    text_tokens: int = 512,
    batch: int = 1,
    cards: int = 1,
    block_size: int | None = None,
    max_context: int | None = None,
    reserve: int | str = 0,
    tp: int | None = None,
) -> Budget:
    """How a request mix fits in device memory, paged and contiguous.

    Args:
        spec: the model.
        device_memory: bytes per card (or a size string such as "16GiB").
        images: images per sequence; text_tokens: text tokens per sequence (prompt + generated).
        batch: concurrent sequences of that shape.
        cards: cards sharing the model by tensor parallelism (weights and KV split across them;
            activation headroom and reserve are counted per card).
        block_size: paged block size (default: the package's, else 128).
        max_context: what a contiguous cache reserves per sequence (default: the model's max positions).
        reserve: memory the runtime keeps for itself per card.
        tp: also give one card's memory under the tensor_parallel pass's split over ``tp`` cards
            (replicated vision, embedding and lm_head; the layers and KV heads split).
    """
    mem = parse_size(device_memory)
    res = parse_size(reserve)
    if min(images, text_tokens) < 0 or batch < 1 or cards < 1:
        raise VlmcError("images and text tokens must be >= 0, batch and cards >= 1")
    bs = block_size or spec.block_size or 128
    ctx_max = max_context or spec.max_positions
    per_tok = spec.kv_bytes_per_token
    per_block = per_tok * bs
    img_tokens = images * spec.tokens_per_image
    seq = img_tokens + text_tokens
    notes = []
    within = seq <= spec.max_positions
    if not within:
        # the runtime refuses a sequence past the context (vlmc/runtime: prepare and the scheduler), so it fits
        # nowhere, whatever the memory says
        notes.append(
            f"{seq} tokens per sequence exceed the model's {spec.max_positions} positions: the runtime refuses "
            "such a sequence, so it does not fit whatever the memory"
        )
    if seq > ctx_max:
        ctx_max = seq
        notes.append("max context raised to the sequence length")
    if spec.count_note:
        notes.append(f"image tokens: {spec.count_note}")
    int4 = _int4_note(spec)
    if int4:
        notes.append(int4)
    act = activation_bytes(spec, seq, images)
    step = paged_step_bytes(spec, seq, batch, bs) // cards
    if step > act:
        notes.append(
            f"a paged decode step of {batch} sequence(s) needs {fmt_bytes(step)} transient per card, more than "
            "the prefill headroom; keep that much free beside the pool"
        )
    free = cards * (mem - act - res) - spec.weight_bytes
    # The pool also holds block 0, which the runtime never gives to a sequence (unused block-table
    # entries point at it): see vlmc/runtime/paged.py NULL_BLOCK and the compiled pool size.
    paged = (batch * math.ceil(seq / bs) + RESERVED_BLOCKS) * per_block
    contiguous = batch * ctx_max * per_tok
    seq_paged = math.ceil(seq / bs) * per_block
    tp_card = (
        tensor_parallel_card(spec, tp, mem, act, res, seq, batch, bs, ctx_max) if tp and tp > 1 else None
    )
    return Budget(
        tensor_parallel=tp_card,
        spec=spec.name,
        device_memory=mem,
        cards=cards,
        weights=[asdict(g) for g in spec.graphs],
        weight_bytes=spec.weight_bytes,
        kv_bytes_per_token=per_tok,
        block_size=bs,
        kv_bytes_per_block=per_block,
        images=images,
        tokens_per_image=spec.tokens_per_image,
        tokens_per_image_unpruned=spec.tokens_per_image_unpruned,
        image_tokens=img_tokens,
        text_tokens=text_tokens,
        sequence_tokens=seq,
        batch=batch,
        activation_bytes=act,
        reserve_bytes=res,
        free_for_kv=free,
        max_context=ctx_max,
        paged_reservation=paged,
        contiguous_reservation=contiguous,
        paged_saving=contiguous - paged,
        fits_paged=within and free >= paged,
        fits_contiguous=within and free >= contiguous,
        max_sequences_paged=max(0, (free - RESERVED_BLOCKS * per_block) // seq_paged) if seq_paged else 0,
        max_sequences_contiguous=max(0, free // (ctx_max * per_tok)),
        max_context_one_sequence=max(0, min(free // per_tok, spec.max_positions)),
        paged_step_bytes=step,
        notes=notes,
    )


def tensor_parallel_card(
    spec: Spec,
    size: int,
    device_memory: int,
    activation: int,
    reserve: int,
    seq: int,
    batch: int,
    block_size: int,
    max_context: int,
) -> dict:
    """Memory on one card when the ``tensor_parallel`` pass splits the decoder over ``size`` cards.

    Vision, embedding and lm_head are replicated (passes/tensor_parallel.py); the decoder layers are
    split 1/size; each card's KV holds its share of the KV heads (all of one where size exceeds them).
    """
    if spec.heads % size:
        raise VlmcError(f"--tp {size} does not divide the model's {spec.heads} attention heads")
    decoder = [g for g in spec.graphs if g.role == "decoder"]
    dec_bytes = sum(g.bytes for g in decoder)
    per_weight = WEIGHT_BYTES.get(decoder[0].precision, 2.0) if decoder else 2.0
    head = int(spec.vocab * spec.hidden * per_weight)  # lm_head, kept whole on every card
    replicated = spec.weight_bytes - dec_bytes + head
    sharded = (dec_bytes - head) // size
    if spec.kv_heads % size == 0:
        kv_heads, kv = spec.kv_heads // size, "split"
    elif size % spec.kv_heads == 0:
        kv_heads, kv = 1, "replicated"
    else:
        raise VlmcError(f"--tp {size} neither divides nor is a multiple of the {spec.kv_heads} KV heads")
    per_tok = 2 * spec.layers * kv_heads * spec.head_dim * DTYPE_BYTES[spec.kv_dtype]
    weights = replicated + sharded
    paged = batch * math.ceil(seq / block_size) * block_size * per_tok
    contiguous = batch * max_context * per_tok
    fixed = weights + activation + reserve
    return {
        "size": size,
        "replicated_bytes": replicated,
        "sharded_bytes": sharded,
        "weight_bytes": weights,
        "kv_heads_per_card": kv_heads,
        "kv": kv,
        "kv_bytes_per_token": per_tok,
        "paged_total": fixed + paged,
        "contiguous_total": fixed + contiguous,
        "fits_paged": fixed + paged <= device_memory,
        "fits_contiguous": fixed + contiguous <= device_memory,
    }


def _int4_note(spec: Spec) -> str | None:
    """What INT4 weights cost on Ascend, where they are held one per int8 (vlmc/backends/ascend lowering)."""
    int4 = [g for g in spec.graphs if g.precision == "int4_weight_only"]
    if not int4:
        return None
    params = sum(g.params for g in int4 if g.params)
    extra = f"; about {fmt_bytes(params * 0.5)} more than counted here" if params else ""
    return (
        f"INT4 runs with INT8 storage on Ascend ({', '.join(g.name for g in int4)}) by default: 1 byte "
        f"per quantized weight on the NPU, not 0.5, so INT4 saves what INT8 does there (0.25x of FP32)"
        f"{extra}; compile target int4_weights: int4 keeps 0.5 (unverified on hardware)"
    )


def paged_step_bytes(spec: Spec, seq: int, batch: int, block_size: int) -> int:
    """Transient device memory of one paged decode step (interface v2), beside the pool itself.

    The pool is read in place and only this step's rows leave the graph, so a step holds no second
    pool; what it does hold, one layer at a time, is each sequence's gathered past (all its blocks,
    K and V), its transpose into the decoder's layout, and the decoder's past-plus-new concat: three
    copies of batch x ceil(seq / block_size) x block_size rows of one layer. The earlier interface
    (whole pool returned every step) needed a second pool-sized buffer instead.
    """
    rows = batch * math.ceil(seq / block_size) * block_size
    return 3 * rows * 2 * spec.kv_heads * spec.head_dim * DTYPE_BYTES[spec.kv_dtype]


def activation_bytes(spec: Spec, seq: int, images: int) -> int:
    """Peak activation memory of one prefill: the larger of the decoder and vision stages.

    An estimate, not a measurement: the decoder keeps ~4 hidden-sized and 3 MLP-sized tensors per
    token for the layer being run, eager attention's scores and probabilities (2 x heads x seq²),
    and the logits of every position (the decoder interface returns [batch, seq, vocab]). The
    vision stage is the same count over its patches, for all images at once.
    """
    a = DTYPE_BYTES[spec.act_dtype]
    dec = seq * (4 * spec.hidden + 3 * spec.intermediate) + 2 * spec.heads * seq * seq + seq * spec.vocab
    v = spec.vision
    vis = 0
    if v and images:
        p = int(v["patches"])
        vis = (
            images
            * spec.vision_rows_per_image
            * (p * (4 * int(v["width"]) + 2 * int(v["intermediate"])) + 2 * int(v["heads"]) * p * p)
        )
    return a * max(dec, vis)


# ---- specs -----------------------------------------------------------------------------------
def parse_image_size(text: str | None) -> tuple[int, int] | None:
    """'HxW' (e.g. 672x1008) -> (h, w)."""
    if text is None:
        return None
    h, sep, w = str(text).lower().partition("x")
    if not sep or not h.strip().isdigit() or not w.strip().isdigit() or not int(h) or not int(w):
        raise VlmcError(f"--image-size {text!r}: write HEIGHTxWIDTH in pixels, e.g. 672x1008")
    return int(h), int(w)


def _package_tokens(v: dict, image_size: tuple[int, int] | None) -> tuple[int, int, str | None, int]:
    """Image tokens per image from the manifest: (tokens, vision-graph rows per image, how they were
    counted, tokens before pruning).

    The fixed count, or the preprocessing kind's count rule (the runtime's own) for ``image_size``: per
    vision row for kinds in ``SIZE_COUNTS`` (tiles: the fixed count is per tile; without a size, the
    worst case), per image for kinds in ``COUNTS`` (anyres: the size is needed).
    """
    import numpy as np

    from vlmc.runtime import preprocess

    tpi = v.get("tokens_per_image")
    facts = v.get("preprocess") or {}
    pruned = v.get("pruning") or {}
    rule = preprocess.SIZE_COUNTS.get(facts.get("kind"))
    if rule is not None:
        before = pruned.get("unpruned_tokens_per_image") or tpi
        tokens, rows, note = rule(v, *(image_size or (None, None)))
        if pruned and pruned.get("unpruned_tokens_per_image") is None and isinstance(tpi, int):
            # a count per image (hd_crops) pruned to k: the rule gives the image's own count, k of which stay
            return tpi, rows, note, tokens
        # a count per image (hd_crops) has no fixed per-row count: unpruned, it is the count itself
        return tokens, rows, note, int(before) * rows if before is not None else tokens
    if isinstance(tpi, int):
        return tpi, 1, None, int(pruned.get("tokens_before", tpi))
    packed = _packed_tokens(facts, image_size)
    if packed is not None:
        return packed, 1, None, packed
    if facts.get("kind") in preprocess.COUNTS:
        if image_size is None:
            raise VlmcError(
                "image tokens depend on the image size in this package "
                f"({facts['kind']} preprocessing); give --image-size HEIGHTxWIDTH"
            )
        n = preprocess.token_counts({"image_sizes": np.array([image_size], np.int64)}, facts)[0]
        return n, 1, None, n
    raise VlmcError(
        "the package has no fixed vision.tokens_per_image (dynamic resolution); "
        "plan needs it: export with a fixed image size"
    )


def spec_from_package(pkg, image_size: tuple[int, int] | None = None) -> Spec:
    """Facts from vlmc.json and weight bytes from the package's graphs.

    ``image_size`` (height, width) counts the image tokens of an image of that size where the count depends
    on it (the preprocessing kind's rule: tiles, anyres); a tiled package without it is planned at its
    worst case.
    """
    m = pkg.manifest
    kv, t, v = m["kv"], m["text"], m["vision"]
    ws = [
        GraphWeights(n, g["role"], g["precision"], None, initializer_bytes(pkg.model(n)))
        for n, g in m["graphs"].items()
    ]
    tpi, rows, note, unpruned = _package_tokens(v, image_size)
    hidden = int(t.get("hidden_size") or kv["kv_heads"] * kv["head_dim"])
    decoder = next(iter(m["pipeline"].get("decoder", [])), None)
    inter = _widest_inner(pkg.model(decoder), hidden, int(t["vocab_size"])) if decoder else 4 * hidden
    precisions = {g["precision"] for g in m["graphs"].values() if g["role"] in ("decoder", "vlm")}
    return Spec(
        name=m["model"]["source"],
        graphs=ws,
        layers=int(kv["layers"]),
        kv_heads=int(kv["kv_heads"]),
        head_dim=int(kv["head_dim"]),
        kv_dtype=kv.get("dtype", "float32"),
        tokens_per_image=tpi,
        tokens_per_image_unpruned=unpruned,
        max_positions=int(t.get("max_positions", 4096)),
        hidden=hidden,
        heads=max(1, hidden // int(kv["head_dim"])),
        intermediate=inter,
        vocab=int(t["vocab_size"]),
        act_dtype="float32" if precisions <= {"fp32"} else "float16",
        block_size=kv.get("block_size") if kv.get("layout") == "paged" else None,
        vision_rows_per_image=rows,
        count_note=note,
    )


def _packed_tokens(pre: dict, image_size: tuple[int, int] | None) -> int | None:
    """Dynamic resolution (preprocess kind packed_patches, Qwen-VL / GLM-4.1V): the tokens of an
    ``image_size`` image by the runtime's own smart-resize rule, else the most one image can give under the
    processor's max_pixels bound (smart resize keeps every image at or below it); None for other kinds."""
    if pre.get("kind") != "packed_patches" or not pre.get("max_pixels"):
        return None
    from vlmc.runtime import patches

    patch, merge = int(pre["patch_size"]), int(pre["merge_size"])
    factor = patch * merge
    if image_size is not None:
        rule = patches.RESIZE_RULES.get(pre.get("resize", "pixels"), patches.smart_resize)
        h, w = rule(
            int(image_size[0]), int(image_size[1]), factor, int(pre["min_pixels"]), int(pre["max_pixels"])
        )
        return (h // patch) * (w // patch) // (merge * merge)
    bound = int(pre["max_pixels"])
    if pre.get("resize") == "temporal_pixels":  # the bound counts the frames a still image is repeated into
        bound //= int(pre.get("temporal_patch_size", 2))
    return bound // (factor * factor)


def _widest_inner(model, hidden: int, vocab: int) -> int:
    # The MLP width is the largest weight dimension that is neither the hidden size nor the vocabulary.
    # Shapes only: the IR's weights stay in their files.
    shapes = [v.const_value.shape for v in model.graph.initializers.values() if v.const_value is not None]
    dims = {int(d) for shape in shapes if len(shape) == 2 for d in shape}
    inner = [d for d in dims if d not in (hidden, vocab)]
    return max(inner) if inner else 4 * hidden


def spec_from_dict(d: dict, name: str = "spec") -> Spec:
    """A neutral sizing spec (``"vlmc_spec": 1``): transformer dimensions and precisions, no weights.

    Parameters are counted from the dimensions (attention with kv_heads, gated or plain MLP, norms,
    embeddings, untied lm_head unless ``tied``); ``extra_params`` adds what the formula does not
    model (e.g. a resampler).
    """
    try:
        llm, vis, prec = d["llm"], d["vision"], d.get("precision", {})
        h, layers = int(llm["hidden"]), int(llm["layers"])
        heads = int(llm["heads"])
        kv_heads = int(llm.get("kv_heads", heads))
        head_dim = int(llm.get("head_dim", h // heads))
        inter, vocab = int(llm["intermediate"]), int(llm["vocab"])
        mlp_mats = 3 if llm.get("gated_mlp", True) else 2
        attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
        if llm.get("qkv_bias"):
            attn += (heads + 2 * kv_heads) * head_dim
        block = attn + mlp_mats * h * inter + 2 * h
        dec = layers * block + h + (0 if llm.get("tied") else vocab * h)
        emb = vocab * h
        w, vl, vi = int(vis["width"]), int(vis["layers"]), int(vis["intermediate"])
        patches = (int(vis["image_size"]) // int(vis["patch_size"])) ** 2
        vblock = 4 * w * w + 4 * w + 2 * w * vi + vi + w + 4 * w
        # Patch embedding, positions, class token and pre/post LayerNorm of a ViT.
        stem = 3 * int(vis["patch_size"]) ** 2 * w + (patches + 1) * w + 5 * w
        vparams = vl * vblock + stem + int(vis.get("extra_params", 0))
        graphs = []
        for gname, role, params in (
            ("vision_encoder", "vision", vparams),
            ("embed_tokens", "embed", emb),
            ("decoder", "decoder", dec),
        ):
            p = prec.get(role, "fp16")
            if p not in WEIGHT_BYTES:
                raise VlmcError(f"{name}: precision.{role}={p!r} is not one of {', '.join(WEIGHT_BYTES)}")
            graphs.append(GraphWeights(gname, role, p, params, int(params * WEIGHT_BYTES[p])))
        tpi = int(vis["tokens_per_image"])
        return Spec(
            name=d.get("name", name),
            graphs=graphs,
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            kv_dtype=d.get("kv_dtype", "float16"),
            tokens_per_image=tpi,
            tokens_per_image_unpruned=int(vis.get("tokens_per_image_unpruned", tpi)),
            max_positions=int(llm["max_positions"]),
            hidden=h,
            heads=heads,
            intermediate=inter,
            vocab=vocab,
            act_dtype=d.get("act_dtype", "float16"),
            vision={"patches": patches + 1, "width": w, "intermediate": vi, "heads": int(vis["heads"])},
        )
    except KeyError as exc:
        raise VlmcError(
            f"{name}: sizing spec lacks {exc.args[0]!r} (see docs/paged_kv.md for the format)"
        ) from None


def spec_from_hf_config(
    d: dict,
    precision: dict | None = None,
    name: str = "config",
    image_size: tuple[int, int] | None = None,
    directory: Path | None = None,
) -> Spec:
    """Count parameters of a Hugging Face config of a family vlmc exports, on the meta device (no weights).

    The decoder's parameters are those of ``get_decoder()`` (minus its input embeddings) plus
    ``lm_head``; the embedding table is its own graph; everything else is the image side.
    """
    import torch
    from transformers import AutoConfig

    d = {k: v for k, v in d.items() if k not in ("architectures", "transformers_version", "_name_or_path")}
    exporters.families()  # the native families register their config classes (Qwen-VL's model_type "qwen")
    try:
        config = AutoConfig.for_model(**d)
    except (ValueError, KeyError, TypeError) as exc:
        raise VlmcError(
            f"{name}: transformers cannot read this config ({str(exc).splitlines()[0]}); "
            "describe the model with a vlmc sizing spec instead (docs/paged_kv.md)"
        ) from exc
    family = exporters._family_for_config(config, name)
    mod = exporters.families()[family]
    with torch.device("meta"):
        cls = mod.model_class()
        # an auto class (families that serve several architectures) picks the class from the config
        model = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    prec = {"vision": "fp16", "embed": "fp16", "decoder": "fp16", **(precision or {})}
    emb = model.get_input_embeddings()
    dec = model.get_decoder()
    emb_ids = {id(p) for p in emb.parameters()}
    dec_ids = {id(p) for p in dec.parameters()} - emb_ids
    head_ids = {id(p) for p in model.get_output_embeddings().parameters()} - emb_ids
    count = {"embed": 0, "decoder": 0, "vision": 0}
    for p in model.parameters():
        role = "embed" if id(p) in emb_ids else ("decoder" if id(p) in dec_ids | head_ids else "vision")
        count[role] += p.numel()
    if getattr(config, "tie_word_embeddings", False) or getattr(
        config.get_text_config(), "tie_word_embeddings", False
    ):
        count["decoder"] += emb.weight.numel()  # the decoder graph holds its own copy of a tied head
    graphs = [
        GraphWeights(g, r, prec[r], count[r], int(count[r] * WEIGHT_BYTES[prec[r]]))
        for g, r in (("vision_encoder", "vision"), ("embed_tokens", "embed"), ("decoder", "decoder"))
    ]
    # a native rebuild states its decoder's config (Qwen-VL: Qwen2's, at the package's context) and ViT sizes
    t = mod.text_config(config) if hasattr(mod, "text_config") else config.get_text_config()
    v = getattr(config, "vision_config", None)
    heads = int(t.num_attention_heads)
    head_dim = int(getattr(t, "head_dim", None) or t.hidden_size // heads)
    tpi, rows, note = _tokens_per_image(mod, config, image_size, directory, name)
    vision = mod.vision_dims(config) if hasattr(mod, "vision_dims") else {}
    if not vision and v is not None and getattr(v, "image_size", None) and getattr(v, "patch_size", None):
        vision = {
            "patches": (_side(v.image_size) // _side(v.patch_size)) ** 2 + 1,
            "width": int(v.hidden_size),
            "intermediate": int(v.intermediate_size),
            "heads": int(v.num_attention_heads),
        }
    return Spec(
        name=name,
        graphs=graphs,
        layers=int(t.num_hidden_layers),
        kv_heads=int(getattr(t, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        kv_dtype="float16",
        tokens_per_image=tpi,
        tokens_per_image_unpruned=tpi,
        max_positions=int(t.max_position_embeddings),
        hidden=int(t.hidden_size),
        heads=heads,
        intermediate=int(t.intermediate_size),
        vocab=int(t.vocab_size),
        vision=vision,
        vision_rows_per_image=rows,
        count_note=note,
    )


def _side(v) -> int:
    # Configs give a square side as an int or as [height, width] (e.g. InternVL's vision config).
    return int(v[0]) if isinstance(v, (list, tuple)) else int(v)


def _tokens_per_image(mod, config, image_size, directory, name) -> tuple[int, int, str | None]:
    """(image tokens per image, vision-graph rows per image, how counted) from a config."""
    fn = getattr(mod, "tokens_per_image", None)
    if fn is None:
        raise VlmcError(
            f"the {mod.__name__} exporter does not state tokens per image for a config; "
            "use a vlmc sizing spec"
        )
    fixed = fn(config)
    family = getattr(mod, "FAMILY", None)  # generic tier: the family's count rule for an image size
    if fixed is not None and (image_size is None or family is None):
        return int(fixed), 1, None
    if family is None:
        raise VlmcError(f"the {mod.__name__} exporter states no tokens per image for this config")
    if image_size is None:
        raise VlmcError(
            f"{name}: image tokens of this {family.name} model depend on the image size; "
            "give --image-size HEIGHTxWIDTH"
        )
    h, w = image_size
    tokens = int(family.tokens_for_size(config, h, w, directory))
    rows_fn = getattr(family, "vision_rows_for_size", None)
    rows = int(rows_fn(config, h, w, directory)) if rows_fn else 1
    return tokens, rows, f"{h}x{w}: {tokens} tokens" + (f" in {rows} tiles" if rows > 1 else "")


# a quantize key (a role, or the graph name the exporters give that role) -> the plan's role
_PLAN_ROLES = {
    "vision": "vision",
    "vision_encoder": "vision",
    "embed": "embed",
    "embed_tokens": "embed",
    "decoder": "decoder",
}


@dataclass
class RecipePlan:
    """What a recipe changes about the memory plan of the model it is run on (:func:`recipe_plan`)."""

    precision: dict  # role -> precision, for the roles its quantize step sets
    prune: dict | None  # prune_visual_tokens' keep / ratio
    block_size: int | None  # paged_kv's block size


def _precision(graph: dict) -> str | None:
    weights, acts = graph.get("weights"), graph.get("activations")
    if weights == "int8":
        return "int8" if acts == "int8" else "int8_weight_only"
    return {"int4": "int4_weight_only", "fp16": "fp16", "fp32": "fp32"}.get(weights)


def recipe_plan(recipe) -> RecipePlan:
    """The precisions (quantize), image tokens (prune_visual_tokens' keep) and block size (paged_kv) a validated
    recipe (vlmc/recipe.py) gives the model, for `vlmc plan --config ... --recipe ...`. Roles the recipe does not
    quantize keep the plan's default (fp16, what the device runs a float graph in)."""
    precision, prune, block = {}, None, None
    for step in recipe.steps:
        o = step.options
        if step.name == "quantize":
            for key, graph in o.items():
                role = _PLAN_ROLES.get(key)
                if role is not None and isinstance(graph, dict) and _precision(graph) is not None:
                    precision[role] = _precision(graph)
        elif step.name == "prune_visual_tokens":
            prune = {"keep": o.get("keep"), "ratio": o.get("ratio")}
        elif step.name == "paged_kv":
            block = int(o.get("block_size") or 128)
    return RecipePlan(precision, prune, block)


def with_recipe(spec: Spec, plan: RecipePlan) -> Spec:
    """``spec`` with the recipe's pruned image tokens and paged block size (its precisions go to the counting)."""
    if plan.prune is not None:
        n = spec.tokens_per_image_unpruned
        # k as passes/prune_visual_tokens' keep_count: keep, or the ratio of the tokens rounded (at least 1)
        keep = plan.prune["keep"]
        k = int(keep) if keep is not None else max(1, int(round(float(plan.prune["ratio"]) * n)))
        spec.tokens_per_image = min(k, n)
    if plan.block_size is not None:
        spec.block_size = plan.block_size
    return spec


def load_spec(
    path: str | Path, precision: dict | None = None, image_size: tuple[int, int] | None = None
) -> Spec:
    """A Spec from a file: a vlmc sizing spec (JSON or YAML) or a Hugging Face config.json.

    A config.json beside its processor files is counted with that processor's settings (``image_size``).
    """
    p = Path(path)
    if not p.is_file():
        raise VlmcError(f"config {p} does not exist")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            d = yaml.safe_load(text)
        else:
            d = json.loads(text)
    except Exception as exc:
        raise VlmcError(f"{p}: cannot parse ({str(exc).splitlines()[0]})") from exc
    if not isinstance(d, dict):
        raise VlmcError(f"{p}: expected a mapping")
    if d.get("vlmc_spec"):
        if precision:
            d = dict(d, precision={**d.get("precision", {}), **precision})
        return spec_from_dict(d, name=str(p))
    name = p.parent.name if p.name == "config.json" else p.stem
    has_processor = any(
        (p.parent / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")
    )
    directory = p.parent if p.name == "config.json" and has_processor else None
    return spec_from_hf_config(d, precision, name=name, image_size=image_size, directory=directory)
