"""Phi-3-vision family exporter (Phi-3-vision-128k-instruct, Phi3VForCausalLM): CLIP ViT-L/14-336 + HD crops +
Phi-3-mini, native.

The hub repository is remote code only (``model_type`` "phi3_v", ``auto_map``); vlmc runs none of it. The model is
rebuilt from config.json and the weights:

- the vision tower is transformers' ``CLIPVisionModel`` (the remote code builds ViT-L/14-336 from a constant,
  ``CLIP_VIT_LARGE_PATCH14_336_CONFIG``; its hidden state ``img_processor.layer_idx`` (-2) is the output of a tower
  cut to that depth, so the layers after it are not built); the HD-crop transform (2 x 2 patch merge, ``sub_GN``
  after every row of the crop grid and of the global image, ``glb_GN`` between them) is one gather over the table
  [every crop's merged tokens, sub_GN, glb_GN] (:class:`Phi3VEmbedding`), whose indices the runtime computes
  (vlmc/runtime/hd_crops.py), then the 2-layer projection;
- the language model is Phi-3-mini, which is transformers' ``Phi3ForCausalLM`` and, with its fused ``qkv_proj`` /
  ``gate_up_proj`` split in rows, transformers' native ``LlamaForCausalLM`` (the same logits, tests compare them);
  rope_scaling type "su" is read as "longrope" (the same short/long factors and attention factor). The Llama form
  is exported because the tensor_parallel pass slices separate q/k/v and gate/up projections; the shared decoder
  wrapper, paged KV, tensor parallelism and quantization apply unchanged.

Sources read (the remote code of microsoft/Phi-3-vision-128k-instruct as mirrored on GitHub, e.g. in
Aritra02091998/Phi-3-vision-128k-instruct-Improvised-for-QLORA-Training and g1y5x3/vlm-study):
``image_embedding_phi3_v.py`` (Phi3ImageEmbedding: hd_feature_transform, reshape_hd_patches_2x2merge,
add_image_newline, the negative image ids), ``image_processing_phi3_v.py`` / ``processing_phi3_v.py`` (HD_transform,
num_img_tokens, the per-chunk tokenization), config.json / preprocessor_config.json (as listed in sdpython's
onnx-diagnostic untrained-model configs and the g1y5x3/vlm-study copy). vLLM's phi3v.py names ``<|image|>`` as
32044. See docs/families.md for what differs from the remote code.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from vlmc import paths, samples
from vlmc.errors import VlmcError
from vlmc.exporters import attention, base, checkpoint, native, processor, streaming, zoo
from vlmc.exporters._facts import CLIP_MEAN, CLIP_STD, kv_facts, text_facts
from vlmc.package import Package
from vlmc.runtime import hd_crops, markers

logger = logging.getLogger(__name__)

MODEL_TYPES = ("phi3_v",)
ARCHITECTURES = ("Phi3VForCausalLM",)

# image_embedding_phi3_v.CLIP_VIT_LARGE_PATCH14_336_CONFIG: the tower the remote code always builds.
CLIP_VIT_L_336 = {
    "hidden_size": 1024,
    "image_size": 336,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "patch_size": 14,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
# processing_phi3_v: every chunk between <|image_N|> tags is tokenized on its own (a BOS each); the image rows hold
# -N. vlmc's prompt marker is the numbered tag; its rows get image_token_id (<unk>, 0: the remote embedding clamps
# the negative ids to 0 before it overwrites them), and ``text.image_row_ids`` "free" tells verify so.
IMAGE_MARKER = "<|image_{n}|>"
IMAGE_TOKEN = "<unk>"
# The chat template of the hub's tokenizer_config.json for one user turn with string content, the model card's
# layout: "<|user|>\n<|image_1|>\n{prompt}<|end|>\n<|assistant|>\n".
PROMPT_TEMPLATE = "<|user|>\n{images}{prompt}<|end|>\n<|assistant|>\n"
IMAGE_TURN = IMAGE_MARKER + "\n"
CROP = 336  # processing_phi3_v's HD_transform and padding_336 use 336 as written, whatever the tower says


class Phi3VConfig(PretrainedConfig):
    """config.json of a Phi-3-vision repository (configuration_phi3_v.Phi3VConfig's fields), read without its code."""

    model_type = "phi3_v"

    def __init__(
        self,
        vocab_size: int = 32064,
        hidden_size: int = 3072,
        intermediate_size: int = 8192,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 4096,
        original_max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        sliding_window: int | None = None,
        embd_layer: dict | None = None,
        img_processor: dict | None = None,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        bos_token_id: int | None = 1,
        eos_token_id=2,
        pad_token_id: int | None = None,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.original_max_position_embeddings = original_max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.su_rope = dict(rope_scaling) if isinstance(rope_scaling, dict) else None
        self.sliding_window = sliding_window
        self.embd_layer = dict(embd_layer or {})
        self.img_processor = dict(img_processor or {})
        self.initializer_range = initializer_range
        kwargs.pop("rope_parameters", None)
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["rope_scaling"] = out.pop("su_rope", None)
        return out


def _register() -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.register("phi3_v", Phi3VConfig)
    except ValueError:  # already registered (a module reload)
        pass


_register()


def model_class():
    return Phi3VForConditionalGeneration


def check_supported(cfg, where: str) -> None:
    """Refuse what the native rebuild does not reproduce, in one line."""
    e, ip = cfg.embd_layer, cfg.img_processor
    if ip.get("name", "clip_vision_model") != "clip_vision_model":
        raise VlmcError(
            f"{where}: img_processor {ip.get('name')!r} is not supported (the remote code has clip only)"
        )
    if not (e.get("use_hd_transform") and e.get("with_learnable_separator")):
        raise VlmcError(
            f"{where}: embd_layer without use_hd_transform + with_learnable_separator is not supported"
        )
    if e.get("hd_transform_order", "glb_sub") != "sub_glb":
        raise VlmcError(
            f"{where}: hd_transform_order {e.get('hd_transform_order', 'glb_sub')!r}: the remote code implements "
            "sub_glb only"
        )
    if e.get("projection_cls", "linear") != "mlp":
        raise VlmcError(
            f"{where}: projection_cls {e.get('projection_cls', 'linear')!r}: the HD transform needs mlp"
        )
    if ip.get("type_feature", "patch") != "patch":
        raise VlmcError(
            f"{where}: img_processor.type_feature {ip.get('type_feature')!r}: only 'patch' exists"
        )
    clip = clip_config(cfg)
    if int(ip.get("image_dim_out", clip.hidden_size)) != clip.hidden_size:
        raise VlmcError(f"{where}: img_processor.image_dim_out must be the tower's width {clip.hidden_size}")
    if clip.image_size != CROP or (clip.image_size // clip.patch_size) % 2:
        raise VlmcError(
            f"{where}: the HD transform crops {CROP}x{CROP} images into an even patch grid; the tower has "
            f"image_size {clip.image_size}, patch_size {clip.patch_size}"
        )
    rs = cfg.su_rope
    if rs and str(rs.get("type", rs.get("rope_type"))) not in ("su", "longrope"):
        raise VlmcError(f"{where}: rope_scaling type {rs.get('type')!r} is not supported (Phi-3-V uses su)")
    if int(cfg.hidden_size) % int(cfg.num_attention_heads):
        raise VlmcError(f"{where}: hidden_size is not divisible by num_attention_heads")


def clip_config(cfg):
    """The CLIP tower: ViT-L/14-336 as the remote code builds it, widths overridable for narrow copies
    (``img_processor.vision_config``: vlmc's own key; the remote code ignores it), cut at ``layer_idx``."""
    from transformers import CLIPVisionConfig

    ip = cfg.img_processor
    kw = {**CLIP_VIT_L_336, **(ip.get("vision_config") or {})}
    depth = int(kw["num_hidden_layers"])
    layer = int(ip.get("layer_idx", -2))
    used = depth + 1 + layer if layer < 0 else layer
    if not 1 <= used <= depth:
        raise VlmcError(f"img_processor.layer_idx={layer} is outside the tower's {depth} layers")
    kw["num_hidden_layers"] = used
    out = CLIPVisionConfig(**kw)
    out._attn_implementation = "eager"
    return out


def _rope(cfg) -> dict:
    """rope_scaling "su" as transformers' "longrope": the same factors and the same attention factor
    sqrt(1 + ln(max / original) / ln(original))."""
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.su_rope:
        rope = {
            "rope_type": "longrope",
            "rope_theta": float(cfg.rope_theta),
            "short_factor": [float(x) for x in cfg.su_rope["short_factor"]],
            "long_factor": [float(x) for x in cfg.su_rope["long_factor"]],
            "original_max_position_embeddings": int(cfg.original_max_position_embeddings),
            "factor": int(cfg.max_position_embeddings) / int(cfg.original_max_position_embeddings),
        }
    return rope


def _decoder_fields(cfg) -> dict:
    """The decoder's config fields both forms share: widths, depth, rope (long rope as rope_parameters), eager
    attention, and no special token ids (the runtime takes them from the tokenizer files)."""
    return dict(
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_hidden_layers=int(cfg.num_hidden_layers),
        num_attention_heads=int(cfg.num_attention_heads),
        num_key_value_heads=int(cfg.num_key_value_heads),
        hidden_act=str(cfg.hidden_act),
        max_position_embeddings=int(cfg.max_position_embeddings),
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope_parameters=_rope(cfg),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def llama_config(cfg):
    """The decoder as transformers' LlamaConfig: Phi-3-mini with separate q/k/v and gate/up projections (no biases)."""
    from transformers import LlamaConfig

    return LlamaConfig(**_decoder_fields(cfg), attention_bias=False, mlp_bias=False)


def phi3_config(cfg):
    """transformers' Phi3Config of the same decoder (the reference the Llama form is tested against)."""
    from transformers import Phi3Config

    return Phi3Config(
        **_decoder_fields(cfg),
        original_max_position_embeddings=int(cfg.original_max_position_embeddings),
        # the remote's eager mask applies sliding_window (131072 in the hub config, the whole context): no effect
        sliding_window=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
    )


# ---------------------------------------------------------------- vision (image_embedding_phi3_v.py, reimplemented)


class Phi3VEmbedding(nn.Module):
    """Phi3ImageEmbedding's vision part, under its parameter names: ``img_processor`` (CLIPVisionModel), ``glb_GN``,
    ``sub_GN``, ``img_projection`` (Linear, GELU, Linear). The HD layout is a gather over the feature table."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import CLIPVisionModel

        clip = clip_config(config)
        self.img_processor = CLIPVisionModel(clip)
        self.grid = clip.image_size // clip.patch_size  # 24: patches per crop side
        dim = 4 * clip.hidden_size
        hidden = int(config.hidden_size)
        self.glb_GN = nn.Parameter(torch.zeros(1, 1, dim))
        self.sub_GN = nn.Parameter(torch.zeros(1, 1, 1, dim))
        self.img_projection = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))

    def table(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, crops, 3, S, S] -> [images * crops * (grid/2)², 4C] merged tokens, then sub_GN and glb_GN."""
        x = self.img_processor(pixel_values.flatten(0, 1)).last_hidden_state[:, 1:]  # patch features
        c, h = x.shape[-1], self.grid // 2
        # reshape_hd_patches_2x2merge: each 2 x 2 block of patches becomes one token of 4C, row-major per crop
        x = x.reshape(-1, h, 2, h, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4 * c)
        return torch.cat([x, self.sub_GN.reshape(1, -1), self.glb_GN.reshape(1, -1)])

    def forward(self, pixel_values: torch.Tensor, image_feature_index: torch.Tensor) -> torch.Tensor:
        return self.img_projection(self.table(pixel_values)[image_feature_index])


def preprocess_facts(config, directory=None) -> dict:
    """image_processing_phi3_v's preprocessing (vlmc/runtime/hd_crops.py) with the processor config's num_crops."""
    pc = (paths.model_json(directory, "preprocessor_config.json") if directory is not None else None) or {}
    num_crops = int(pc.get("num_crops", getattr(config, "num_crops", 16)))
    clip = clip_config(config)
    return {
        "kind": "hd_crops",
        "num_crops": num_crops,
        "crop_size": CROP,
        "crop_tokens_side": clip.image_size // clip.patch_size // 2,
        "mean": [float(x) for x in pc.get("image_mean", CLIP_MEAN)],
        "std": [float(x) for x in pc.get("image_std", CLIP_STD)],
        "rescale_factor": 1 / 255,
        "resample": "bilinear",  # torchvision's resize of a PIL image; the global image is torch's bicubic
    }


# ---------------------------------------------------------------- the whole model


class Phi3VForConditionalGeneration(nn.Module):
    """The native rebuild: ``vision_embed_tokens`` (:class:`Phi3VEmbedding`) + ``language_model`` (LlamaForCausalLM,
    Phi-3-mini with its fused projections split).

    forward/generate take ``input_ids`` whose image rows hold ``image_token_id`` (the runtime's) or negative ids (the
    processor's), ``pixel_values`` [images, crops, 3, 336, 336] and ``image_sizes`` [images, 2] (the HD image's
    h, w); the features replace those rows in order, as the remote embedding's ``index_put`` does.
    """

    def __init__(self, config: Phi3VConfig) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.config = config
        self.vision_embed_tokens = Phi3VEmbedding(config)
        self.language_model = LlamaForCausalLM(llama_config(config))
        self.image_token_id = int(getattr(config, "image_token_id", 0))
        self.preprocess = preprocess_facts(config)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def _embeds(self, input_ids, pixel_values, image_sizes):
        slots = (input_ids < 0) | (input_ids == self.image_token_id)
        embeds = self.get_input_embeddings()(input_ids.clamp(min=0))
        if pixel_values is not None:
            facts = dict(self.preprocess, crop_size=CROP)
            # the crops the batch uses and the gather index (vlmc/runtime/hd_crops.py), as the package's runtime
            feeds = hd_crops.graph_feeds(
                {"pixel_values": pixel_values.numpy(), "image_sizes": np.asarray(image_sizes, np.int64)},
                facts,
            )
            pixels, index = (torch.from_numpy(feeds[k]) for k in ("pixel_values", "image_feature_index"))
            feats = self.vision_embed_tokens(pixels.to(embeds.dtype), index)
            embeds = embeds.masked_scatter(slots.unsqueeze(-1), feats)
        return embeds

    def forward(self, input_ids, attention_mask=None, pixel_values=None, image_sizes=None, **_):
        embeds = self._embeds(input_ids, pixel_values, image_sizes)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions)

    @torch.no_grad()
    def generate(
        self,
        input_ids,
        attention_mask=None,
        pixel_values=None,
        image_sizes=None,
        max_new_tokens=20,
        eos_token_id=None,
        **_,
    ):
        """Greedy decoding with the KV cache (left-padded batches); returns prompt + new ids, as transformers'."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        embeds = self._embeds(input_ids, pixel_values, image_sizes)
        return native.greedy(self.language_model, embeds, mask, input_ids, max_new_tokens, eos_token_id)


_VISION, _LM, _LAYERS = "vision_embed_tokens.", "language_model.", "language_model.model.layers."
_TOWER = _VISION + "img_processor."
# the fused projections the Llama form splits: model key suffix -> (the hub's, which row block of it)
_FUSED = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    # Phi3MLP: gate, up = gate_up_proj(x).chunk(2); down(up * act(gate))
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}


def _row_blocks(config) -> dict[str, list[int]]:
    """The row counts of each fused projection's blocks: qkv_proj q | k | v, gate_up_proj gate | up."""
    head_dim = int(config.hidden_size) // int(config.num_attention_heads)
    q, kv = int(config.num_attention_heads) * head_dim, int(config.num_key_value_heads) * head_dim
    inter = int(config.intermediate_size)
    return {"self_attn.qkv_proj.weight": [q, kv, kv], "mlp.gate_up_proj.weight": [inter, inter]}


def hub_key(key: str, config) -> tuple[str, tuple[int, int] | None]:
    """Where this module's weight ``key`` is in the hub checkpoint: (checkpoint key, rows or None).

    ``vision_embed_tokens.*`` is ``model.vision_embed_tokens.*`` (the remote code's CLIPVisionModel, transformers 4,
    nests the tower in ``vision_model``; transformers 5's holds it directly); ``language_model.model.*`` /
    ``language_model.lm_head.*`` are ``model.*`` / ``lm_head.*``, with q/k/v the row blocks of ``qkv_proj`` and
    gate/up those of ``gate_up_proj``. (``model.vision_embed_tokens.wte`` is the same table as
    ``model.embed_tokens``, a shared module: nothing maps to it.)
    """
    if key.startswith(_TOWER):
        return "model." + _TOWER + "vision_model." + key[len(_TOWER) :], None
    if key.startswith(_VISION):
        return "model." + key, None
    if key.startswith(_LAYERS):
        layer, rel = key[len(_LAYERS) :].split(".", 1)
        if rel in _FUSED:
            fused, block = _FUSED[rel]
            sizes = _row_blocks(config)[fused]
            start = sum(sizes[:block])
            return f"model.layers.{layer}.{fused}", (start, start + sizes[block])
    if key.startswith(_LM):
        return key[len(_LM) :], None
    raise KeyError(key)


def to_hub_state_dict(model: Phi3VForConditionalGeneration, full_depth: int | None = None) -> dict:
    """This model's weights under the hub checkpoint's names (tests write narrow random-weight copies of the
    published repository with it). ``full_depth``: tower layers to write (the cut ones as random copies)."""
    sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        if k.startswith("vision_embed_tokens."):
            out["model." + k.replace(".img_processor.", ".img_processor.vision_model.", 1)] = v
        elif k.startswith("language_model.") and not k.endswith(
            ("k_proj.weight", "v_proj.weight", "up_proj.weight")
        ):
            name = k[len("language_model.") :]
            if name.endswith("q_proj.weight"):
                head = k[: -len("q_proj.weight")]
                fused = [sd[f"{head}{p}_proj.weight"] for p in ("q", "k", "v")]
                out[name.replace("q_proj", "qkv_proj")] = torch.cat(fused)
            elif name.endswith("gate_proj.weight"):
                head = k[: -len("gate_proj.weight")]
                out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([v, sd[head + "up_proj.weight"]])
            else:
                out[name] = v
    out["model.vision_embed_tokens.wte.weight"] = sd["language_model.model.embed_tokens.weight"]
    used = model.vision_embed_tokens.img_processor.config.num_hidden_layers
    layers = "model.vision_embed_tokens.img_processor.vision_model.encoder.layers."
    g = torch.Generator().manual_seed(1)
    for i in range(used, full_depth or used):
        for k, v in sd.items():
            head = "vision_embed_tokens.img_processor.encoder.layers.0."
            if k.startswith(head):
                out[f"{layers}{i}.{k[len(head) :]}"] = torch.randn(v.shape, generator=g) * 0.02
    return {k: v.contiguous().clone() for k, v in out.items()}


def _load(path: Path, config, built) -> Phi3VForConditionalGeneration:
    """Build the model of ``built`` (``config``, or a copy with its layer stacks cut) on the meta device and load
    its weights from the checkpoint one tensor at a time in FP32, reading only the rows each weight is (a fused
    projection's blocks of qkv_proj / gate_up_proj, each checked against the blocks' sum)."""
    check_supported(config, str(path))
    held = checkpoint.tensors(path)
    blocks = _row_blocks(config)

    def checkpoint_for(expected: dict) -> streaming.Checkpoint:
        return native.mapped_checkpoint(
            path,
            held,
            expected,
            lambda key: hub_key(key, config),
            lambda name: sum(blocks[name.split(".", 3)[3]]),
        )

    def clip_positions(model) -> None:  # CLIP's position ids: a computed buffer, in no checkpoint
        emb = model.vision_embed_tokens.img_processor.embeddings
        emb.register_buffer("position_ids", torch.arange(emb.num_positions).expand((1, -1)), persistent=False)

    model = native.load(
        path, Phi3VForConditionalGeneration, config, built, checkpoint_for, rebuild=clip_positions
    )
    model.preprocess = preprocess_facts(built, path)
    return model


def _native_config(config):
    cfg = copy.deepcopy(config)
    cfg.image_token_id = 0  # <unk>: see IMAGE_TOKEN
    return cfg


def load_local(path: Path, config) -> Phi3VForConditionalGeneration:
    """Build the native model from a hub directory's config and safetensors weights (no repo code)."""
    cfg = _native_config(config)
    return _load(path, cfg, cfg)


def load_reduced(path: Path, config):
    """The model with its two layer stacks (the CLIP tower's layers up to ``layer_idx`` and the decoder's) cut to
    the streaming export's traced depth, for ``vlmc export`` / ``vlmc build`` (vlmc/exporters/streaming.py): the
    other layers' weights are streamed from the checkpoint into the stitched graphs, q/k/v and gate/up as their
    rows of qkv_proj / gate_up_proj. Returns ``(model, full config)``, or None when neither stack is deeper than
    the trace."""
    cfg = _native_config(config)
    traced = streaming.TRACED_LAYERS
    tower = int(clip_config(cfg).num_hidden_layers)  # the layers up to layer_idx: the ones the graph uses
    depths = {"lm": int(cfg.num_hidden_layers), "vision": tower}
    if max(depths.values()) <= traced:
        return None
    reduced = copy.deepcopy(cfg)
    reduced.num_hidden_layers = min(depths["lm"], traced)
    vc = dict(reduced.img_processor.get("vision_config") or {})
    # the tower is built cut at layer_idx: the reduced one is `traced` layers up to its (negative) feature layer
    layer = int(reduced.img_processor.get("layer_idx", -2))
    vc["num_hidden_layers"] = min(tower, traced) + (-layer - 1 if layer < 0 else 0)
    reduced.img_processor = {**reduced.img_processor, "vision_config": vc}
    if layer >= 0:
        reduced.img_processor["layer_idx"] = min(tower, traced)
    model = _load(path, cfg, reduced)
    native.stream_stacks(
        model,
        [
            (
                _TOWER + "encoder.layers",
                model.vision_embed_tokens.img_processor.encoder.layers,
                depths["vision"],
            ),
            (_LAYERS[:-1], model.language_model.model.layers, depths["lm"]),
        ],
    )
    return model, cfg


# ---------------------------------------------------------------- long rope in the graph


class LongRopeSwitch(nn.Module):
    """Phi-3's long rope with the switch in the graph: each row uses the long factors when its largest position
    + 1 passes ``original_max_position_embeddings``, else the short ones (transformers' ``longrope_frequency_update``
    and the remote Phi3SuScaledRotaryEmbedding decide once per call, from the batch's largest position; one row
    alone decides the same). The cos/sin arithmetic is Phi3RotaryEmbedding.forward's."""

    def __init__(self, rotary, config) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.original = int(config.rope_parameters["original_max_position_embeddings"])
        long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=self.original + 1)
        self.register_buffer("short_inv_freq", rotary.original_inv_freq.clone(), persistent=False)
        self.register_buffer("long_inv_freq", long_inv.float(), persistent=False)
        self.attention_scaling = float(rotary.attention_scaling)

    def forward(self, x, position_ids):
        long = (position_ids.amax(dim=-1, keepdim=True) + 1 > self.original).unsqueeze(-1)  # [batch, 1, 1]
        inv = torch.where(long, self.long_inv_freq, self.short_inv_freq)  # [batch, 1, dim / 2]
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


# ---------------------------------------------------------------- export


def _eos(cfg, directory) -> object:
    gen = paths.model_json(directory, "generation_config.json") if directory is not None else None
    if gen and gen.get("eos_token_id") is not None:
        return gen["eos_token_id"]
    return getattr(cfg, "eos_token_id", None)


def source_tokenizer(directory):
    """tokenizer.json as the remote processor's LlamaTokenizerFast runs it (transformers 4.44: the file as it is,
    its post-processor rebuilt from tokenizer_config's add_bos_token / add_eos_token), or None without the file."""
    from tokenizers import Tokenizer, processors

    data = paths.model_bytes(directory, "tokenizer.json")
    if data is None:
        return None
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise VlmcError(f"{directory}: tokenizer.json is not a tokenizers file ({str(exc)[:120]})") from None
    tc = paths.model_json(directory, "tokenizer_config.json") or {}

    def name(key, default):
        v = tc.get(key, default)
        return str(v.get("content", default)) if isinstance(v, dict) else str(v or default)

    bos, eos = name("bos_token", "<s>"), name("eos_token", "</s>")
    single, specials = ["$A:0"], {}
    if tc.get("add_bos_token", True):
        single.insert(0, f"{bos}:0")
        specials[bos] = tok.token_to_id(bos)
    if tc.get("add_eos_token", False):
        single.append(f"{eos}:0")
        specials[eos] = tok.token_to_id(eos)
    if any(v is None for v in specials.values()):
        raise VlmcError(
            f"{directory}: tokenizer.json has no {bos!r} / {eos!r}, which tokenizer_config.json names"
        )
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), special_tokens=[(k, v) for k, v in specials.items()]
    )
    return tok, {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": name("pad_token", eos),
        "unk_token": IMAGE_TOKEN,
    }


def token_table(facts: dict) -> dict:
    """How the image tokens are gathered from the crops' feature table (read by prune_visual_tokens).

    Row r of the table is crop r // 144's merged token r % 144 (crop_tokens_side² per crop), image i's crops
    (the global image first) start at row i * crops * 144, so its first token, the first HD crop's first, is
    at i * crops * 144 + 144; the table ends in sub_GN and glb_GN. Pruning keeps every one of those
    separators: one sub_GN per feature row (rows * s of the crop grid, s of the global image) and one glb_GN.
    """
    s = int(facts["crop_tokens_side"])
    return {
        "index_input": "image_feature_index",
        "pixels_input": "pixel_values",
        "tile_tokens": s * s,
        "first_row": s * s,
        "separator_rows": 2,
        # the tallest grid (num_crops x 1) has the most rows: num_crops * s + s sub_GN, one glb_GN
        "most_rows": (int(facts["num_crops"]) + 1) * s + 1,
        "what": "HD crops",
        "kept": "separator tokens an image can have: every feature row's sub_GN and the glb_GN are kept",
    }


def attention_facts(vision_graph, clip) -> dict | None:
    """The CLS attention of the feature layer (the cut tower's last): each merged token scores the 2 x 2
    patches it concatenates (keys are [CLS, 24 x 24 patches] per crop)."""
    side = int(clip.image_size) // int(clip.patch_size)
    layer = int(clip.num_hidden_layers) - 1
    groups = [
        [1 + (2 * r + a) * side + 2 * c + b for a in range(2) for b in range(2)]
        for r in range(side // 2)
        for c in range(side // 2)
    ]
    facts = attention.grouped_facts(
        vision_graph, f"/encoder/layers.{layer}/", side * side + 1, 0, groups, "phi3_v"
    )
    if facts:
        facts.update({"layer": layer, "layers": layer + 1})
    return facts


class VisionWrapper(nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.embedding = model.vision_embed_tokens

    def forward(self, pixel_values, image_feature_index):
        return self.embedding(pixel_values, image_feature_index)


def _vision_sample(facts: dict) -> dict[str, np.ndarray]:
    """Two images of different crop grids (1 x 2 and 2 x 1 when num_crops allows), padded as the processor pads."""
    most = int(facts["num_crops"]) + 1
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(2, most, 3, CROP, CROP, generator=g).numpy()
    wide = min(2, int(facts["num_crops"]))
    sizes = np.array([[CROP, wide * CROP], [wide * CROP, CROP]], np.int64)
    return {"pixel_values": pixels, "image_sizes": sizes}


def export(source, pkg: Package) -> None:
    model, cfg = source.model, source.config
    check_supported(cfg, source.name)
    lm = model.language_model
    # the text config at full depth (a streamed source's model is cut to the traced layers; its config is whole)
    tcfg = llama_config(cfg)
    facts = model.preprocess
    m = pkg.manifest
    grid = model.vision_embed_tokens.grid
    m["vision"] = {
        "image_size": None,
        "tokens_per_image": None,
        "dynamic_resolution": True,
        "packed_features": True,
        "image_token_id": int(model.image_token_id),
        "preprocess": facts,
        "patch_grid": [grid, grid],
        "has_cls_token": True,
        "feature_layer": int(cfg.img_processor.get("layer_idx", -2)),
        "hidden_size": int(tcfg.hidden_size),
        "vision_hidden_size": int(model.vision_embed_tokens.img_processor.config.hidden_size),
    }
    directory = source.directory
    converted = None if directory is None else source_tokenizer(directory)
    family = dict(
        prompt_template=PROMPT_TEMPLATE,
        image_marker=IMAGE_MARKER,
        image_turn=IMAGE_TURN,
        tokenize_chunks=True,
        image_row_ids="free",
        add_bos=True,
        max_positions=int(cfg.max_position_embeddings),
    )
    if converted is not None:
        tok, specials = converted
        pad = tok.token_to_id(specials["pad_token"])
        m["text"] = text_facts(
            cfg,
            tcfg,
            eos_token_id=_eos(cfg, directory),
            bos_token_id=tok.token_to_id(specials["bos_token"]),
            pad_token_id=pad if pad is not None else 0,
            image_token=IMAGE_TOKEN,
            **family,
        )
        if tok.token_to_id(IMAGE_TOKEN) != model.image_token_id:
            raise VlmcError(
                f"{source.name}: tokenizer.json has no {IMAGE_TOKEN} at id {model.image_token_id}"
            )
        pkg.files[processor.TOKENIZER_FILE] = tok.to_str().encode("utf-8")
        m["text"].update(
            tokenizer="source",
            tokenizer_file=processor.TOKENIZER_FILE,
            special_tokens={k: v for k, v in specials.items() if k != "unk_token"},
        )
    else:
        m["text"] = text_facts(
            cfg, tcfg, eos_token_id=getattr(cfg, "eos_token_id", None), pad_token_id=0, **family
        )
    m["kv"] = kv = kv_facts(tcfg)
    m["pipeline"] = {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}

    feeds = hd_crops.graph_feeds(_vision_sample(facts), facts)
    args = [torch.from_numpy(feeds["pixel_values"]), torch.from_numpy(feeds["image_feature_index"])]
    vision_graph = base.export_stage(
        pkg,
        "vision_encoder",
        VisionWrapper(model),
        args,
        ["pixel_values", "image_feature_index"],
        ["image_features"],
        {
            "pixel_values": {0: base.IMAGES, 1: "crops"},
            "image_feature_index": {0: "image_tokens"},
            "image_features": {0: "image_tokens"},
        },
        role="vision",
    )
    samples.store(
        pkg,
        "vision_encoder",
        {"pixel_values": feeds["pixel_values"], "image_feature_index": feeds["image_feature_index"]},
    )
    m["vision"]["token_table"] = token_table(facts)
    # the whole config: a streamed model is cut to the traced layers, its graph stitched to full depth
    m["vision"]["attention"] = attention_facts(vision_graph, clip_config(cfg))
    base.export_embed(pkg, lm.get_input_embeddings(), tcfg.vocab_size)
    rotary = lm.model.rotary_emb
    if getattr(rotary, "rope_type", "default") == "longrope":
        lm.model.rotary_emb = LongRopeSwitch(rotary, lm.config)
    try:
        base.export_decoder(
            pkg, lm.model, lm.lm_head, kv["layers"], kv["kv_heads"], kv["head_dim"], tcfg.hidden_size
        )
    finally:
        lm.model.rotary_emb = rotary


# ---------------------------------------------------------------- verify: the processor's inputs, as its code makes them


def reference_inputs(directory, manifest: dict, prompts: list[str], images: list[list]) -> dict:
    """What Phi-3-vision's processor feeds its model (for `vlmc verify`), written from processing_phi3_v.py and
    image_processing_phi3_v.py with torch and PIL as they do: HD_transform (PIL transpose, bilinear resize to the
    crop scale, white padding), ToTensor / Normalize, the global image by torch's bicubic interpolate, crops padded
    to num_crops + 1; each text chunk between <|image_N|> tags tokenized with its own BOS, -N per image row. A plain
    prompt is first put in the chat template's one-turn layout (the model card's "<|image_1|>\\n" + text)."""
    from PIL import Image

    facts = manifest["vision"]["preprocess"]
    t = manifest["text"]
    converted = source_tokenizer(directory)
    if converted is None:
        raise VlmcError(f"{directory}: no tokenizer.json, so no reference tokenizer")
    tok = converted[0]
    side, num_crops = int(facts["crop_size"]), int(facts["num_crops"])
    mean = torch.tensor(facts["mean"], dtype=torch.float32)[:, None, None]
    std = torch.tensor(facts["std"], dtype=torch.float32)[:, None, None]

    def hd(img):
        w, h = img.size
        trans = w < h
        if trans:
            img = img.transpose(Image.TRANSPOSE)
            w, h = img.size
        ratio = w / h
        scale = 1
        while scale * np.ceil(scale / ratio) <= num_crops:
            scale += 1
        scale -= 1
        new_w = int(scale * side)
        new_h = int(new_w / ratio)
        img = img.resize((new_w, new_h), Image.BILINEAR)
        tar = int(np.ceil(new_h / side) * side)
        top = int((tar - new_h) / 2)
        padded = Image.new("RGB", (new_w, tar), (255, 255, 255))
        padded.paste(img, (0, top))
        return padded.transpose(Image.TRANSPOSE) if trans else padded

    def tensor(img):
        x = torch.from_numpy(np.asarray(img, np.uint8).copy()).permute(2, 0, 1).float().div(255)
        return (x - mean) / std

    seqs, pixels, sizes = [], [], []
    for prompt, per in zip(prompts, images):
        text = prompt
        if not markers.count(prompt, t["image_marker"]):
            text = PROMPT_TEMPLATE.replace(
                "{images}", "".join(markers.nth(IMAGE_TURN, n + 1) for n in range(len(per)))
            ).replace("{prompt}", prompt)
        chunks = markers.split(text, t["image_marker"])
        ids = []
        for n, chunk in enumerate(chunks):
            if n:
                hd_img = hd(
                    (Image.open(per[n - 1]) if isinstance(per[n - 1], str) else per[n - 1]).convert("RGB")
                )
                x = tensor(hd_img)
                h, w = x.shape[1:]
                glob = torch.nn.functional.interpolate(x[None], size=(side, side), mode="bicubic")[0]
                crops = (
                    x.reshape(3, h // side, side, w // side, side)
                    .permute(1, 3, 0, 2, 4)
                    .reshape(-1, 3, side, side)
                )
                full = torch.zeros(num_crops + 1, 3, side, side)
                full[: 1 + len(crops)] = torch.cat([glob[None], crops])
                pixels.append(full)
                sizes.append([h, w])
                s = int(facts["crop_tokens_side"])
                count = (h // side * (w // side) + 1) * s * s + 1 + (h // side + 1) * s
                ids += [-n] * count
            ids += tok.encode(chunk, add_special_tokens=True).ids
        seqs.append(ids)
    pad = int(t.get("pad_token_id") or 0)
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    for b, s in enumerate(seqs):  # left padding, as a decoder-only batch is generated
        ids[b, longest - len(s) :] = torch.tensor(s)
        mask[b, longest - len(s) :] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    if pixels:
        out["pixel_values"] = torch.stack(pixels)
        out["image_sizes"] = torch.tensor(sizes, dtype=torch.long)
    return out


# ---------------------------------------------------------------- the tiny built-in


def tiny_phi3_v_config(**over) -> Phi3VConfig:
    """Phi-3-vision-128k-instruct's published structure (config.json: embd_layer sub_glb mlp with learnable
    separators, img_processor clip layer -2, rope_scaling su with 128k / 4k positions, silu, untied head), narrow:
    a 2-layer 64-wide decoder, a 2-layer (after the cut) 32-wide CLIP at 336² / patch 14, 4 crops, the byte
    tokenizer's vocabulary. The long-rope factors are the published ones' first head_dim / 2."""
    head_dim = 16
    kw = dict(
        vocab_size=zoo.TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling={
            "type": "su",
            "short_factor": list(PUBLISHED_SHORT[: head_dim // 2]),
            "long_factor": list(PUBLISHED_LONG[: head_dim // 2]),
        },
        embd_layer={
            "embedding_cls": "image",
            "hd_transform_order": "sub_glb",
            "projection_cls": "mlp",
            "use_hd_transform": True,
            "with_learnable_separator": True,
        },
        img_processor={
            "image_dim_out": 32,
            "model_name": "openai/clip-vit-large-patch14-336",
            "name": "clip_vision_model",
            "num_img_tokens": 144,
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_attention_heads": 2,
                "num_hidden_layers": 3,
                "projection_dim": 32,
            },
        },
        num_crops=4,
        image_token_id=zoo.TINY_IMAGE_TOKEN,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(over)
    return Phi3VConfig(**kw)


# config.json of microsoft/Phi-3-vision-128k-instruct, rope_scaling (48 = head_dim 96 / 2 factors each); the tiny
# model takes the first head_dim / 2 of each.
PUBLISHED_SHORT = (1.05, 1.05, 1.05, 1.1, 1.1, 1.1, 1.2500000000000002, 1.2500000000000002)
PUBLISHED_LONG = (
    1.0299999713897705,
    1.0499999523162842,
    1.0499999523162842,
    1.0799999237060547,
    1.2299998998641968,
    1.2299998998641968,
    1.2999999523162842,
    1.4499999284744263,
)


def build_tiny(config: Phi3VConfig | None = None) -> Phi3VForConditionalGeneration:
    """The tiny model with std-0.2 weights (scaled past width 64) and non-zero separators."""
    model = Phi3VForConditionalGeneration(config if config is not None else tiny_phi3_v_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith("_GN"):
                p.normal_(std=0.2 * min(1.0, (64 / p.shape[-1]) ** 0.5))
            elif name.endswith("bias"):
                p.normal_(std=0.05)
    return model.eval()


zoo.register_builtin("tiny-phi3-v", "phi3_v", build_tiny)
