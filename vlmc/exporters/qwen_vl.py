"""Qwen-VL family exporter (Qwen-VL-Chat, QWenLMHeadModel): ViT-bigG + 256-query resampler + Qwen-7B, native.

The hub repository is remote code only (``model_type`` "qwen", ``auto_map``); vlmc runs none of it. The model is
rebuilt from config.json and the weights:

- the vision tower and resampler are reimplemented here (:class:`QwenVisual`, with the remote ``visual.py``'s
  parameter names, so the checkpoint loads into it unchanged);
- the language model is transformers' native ``Qwen2ForCausalLM``: Qwen-7B is the same network with other
  names (``c_attn`` split into q/k/v, ``w2``/``w1``/``c_proj`` as gate/up/down, ``intermediate_size // 2``),
  so the shared decoder wrapper, streaming, paged KV, tensor parallelism and quantization apply unchanged.

Sources read (the remote code of Qwen/Qwen-VL-Chat, as mirrored on GitHub in x1ngzai/Qwen-VL-Chat-Int4 and
ivattyue/SC-Tune): ``modeling_qwen.py`` (QWenAttention, QWenMLP, RotaryEmbedding, the image rows
``hidden_states[i][a + 1 : b] = images[idx]`` between ``<img>`` and ``</img>``), ``visual.py`` (VisionTransformer,
Resampler, VisualAttention, get_abs_pos), ``tokenization_qwen.py`` (the 217 special tokens after the BPE ranks,
NFC, ``<img>`` + 256 positions + ``</img>``), ``qwen_generation_utils.py`` (make_context, chatml).
See docs/families.md for what differs from the remote code.
"""

from __future__ import annotations

import copy
import logging
import math
import unicodedata
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from vlmc import paths
from vlmc.errors import VlmcError
from vlmc.exporters import base, checkpoint, native, processor, qwen_vl_tokenizer, streaming, zoo
from vlmc.exporters._facts import CLIP_MEAN, CLIP_STD, kv_facts, text_facts
from vlmc.package import Package

logger = logging.getLogger(__name__)

MODEL_TYPES = ("qwen",)
ARCHITECTURES = ("QWenLMHeadModel",)

# tokenization_qwen.py: the image tags follow ENDOFTEXT, IM_START, IM_END and 205 extras; visual.image_start_id
# is <img>, then </img>, then <imgpad>.
IMG_START, IMG_END, IMG_PAD = "<img>", "</img>", "<imgpad>"
ENDOFTEXT, IM_START, IM_END = (
    qwen_vl_tokenizer.ENDOFTEXT,
    qwen_vl_tokenizer.IM_START,
    qwen_vl_tokenizer.IM_END,
)
IMG_TOKEN_SPAN = 256
SYSTEM = "You are a helpful assistant."
# qwen_generation_utils.make_context (chatml) for one user turn without history; tokenization_qwen.py's
# from_list_format numbers the pictures ("Picture N: <img>...</img>\n"). The marker is where each picture goes.
IMAGE_MARKER = "<img></img>"
CHATML_TEMPLATE = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{{images}}{{prompt}}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
IMAGE_TURN = "Picture {n}: " + IMAGE_MARKER + "\n"
# Qwen's dynamic NTK and logn attention change the math past seq_length tokens (modeling_qwen.py: ntk_alpha
# from the prefill length, logn_tensor for positions > seq_length); the graph implements neither, so the
# package's context is seq_length and longer prompts are refused (docs/families.md).


class QwenVLConfig(PretrainedConfig):
    """config.json of a Qwen-VL repository (configuration_qwen.QWenConfig's fields), read without its code."""

    model_type = "qwen"

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        intermediate_size: int = 22016,
        kv_channels: int = 128,
        layer_norm_epsilon: float = 1e-6,
        rotary_emb_base: float = 10000,
        rotary_pct: float = 1.0,
        seq_length: int = 2048,
        max_position_embeddings: int = 8192,
        no_bias: bool = True,
        use_dynamic_ntk: bool = True,
        use_logn_attn: bool = True,
        visual: dict | None = None,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.kv_channels = kv_channels
        self.layer_norm_epsilon = layer_norm_epsilon
        self.rotary_emb_base = rotary_emb_base
        self.rotary_pct = rotary_pct
        self.seq_length = seq_length
        self.max_position_embeddings = max_position_embeddings
        self.no_bias = no_bias
        self.use_dynamic_ntk = use_dynamic_ntk
        self.use_logn_attn = use_logn_attn
        self.visual = dict(visual or {})
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def _register() -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.register("qwen", QwenVLConfig)
    except ValueError:  # already registered (a module reload)
        pass


_register()


def model_class():
    return QwenVLForConditionalGeneration


def tokens_per_image(config) -> int:
    """Image tokens per picture (`vlmc plan --config`): the resampler's queries, whatever the image."""
    return int(config.visual.get("n_queries", IMG_TOKEN_SPAN))


def text_config(config):
    """The decoder's config as `vlmc plan --config` sizes it: Qwen2's, with the package's context (seq_length,
    past which dynamic NTK and logn attention start and vlmc refuses)."""
    return qwen2_config(config)


def vision_dims(config) -> dict:
    """The ViT's sizes for `vlmc plan`'s activation estimate (patches without a CLS row)."""
    v = config.visual
    width = int(v["width"])
    return {
        "patches": (int(v["image_size"]) // int(v["patch_size"])) ** 2,
        "width": width,
        "intermediate": int(width * float(v["mlp_ratio"])),
        "heads": int(v["heads"]),
    }


def check_supported(cfg, where: str) -> None:
    """Refuse what the native rebuild does not reproduce, in one line."""
    v = cfg.visual
    missing = [
        k for k in ("image_size", "patch_size", "width", "layers", "heads", "output_dim") if k not in v
    ]
    if missing:
        raise VlmcError(f"{where}: config.json visual has no {', '.join(missing)}; not a Qwen-VL config")
    if "image_start_id" not in v:
        raise VlmcError(
            f"{where}: config.json visual has no image_start_id; this is Qwen (text only), not Qwen-VL"
        )
    if float(cfg.rotary_pct) != 1.0:
        raise VlmcError(
            f"{where}: rotary_pct={cfg.rotary_pct} (partial rotary) is not supported; Qwen-VL uses 1.0"
        )
    if int(cfg.kv_channels) * int(cfg.num_attention_heads) != int(cfg.hidden_size):
        raise VlmcError(
            f"{where}: kv_channels * num_attention_heads != hidden_size; the Qwen2 mapping needs them equal"
        )
    if int(v["output_dim"]) % 128 or int(v["output_dim"]) != int(cfg.hidden_size):
        raise VlmcError(
            f"{where}: visual.output_dim={v['output_dim']} must be a multiple of 128 (the resampler's heads) "
            f"and equal hidden_size {cfg.hidden_size}"
        )


def qwen2_config(cfg):
    """transformers' Qwen2Config of the same network (Qwen2 has q/k/v biases and no o_proj bias, as c_attn/c_proj)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size) // 2,
        num_hidden_layers=int(cfg.num_hidden_layers),
        num_attention_heads=int(cfg.num_attention_heads),
        num_key_value_heads=int(cfg.num_attention_heads),
        hidden_act="silu",
        max_position_embeddings=int(cfg.seq_length),
        rms_norm_eps=float(cfg.layer_norm_epsilon),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_emb_base)},
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        use_sliding_window=False,
        attn_implementation="eager",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


# ---------------------------------------------------------------- vision (visual.py, reimplemented)


def _abs_pos(abs_pos: torch.Tensor, tokens: int) -> torch.Tensor:
    """visual.get_abs_pos: the learned position table resized (bicubic) to the patch grid when it differs."""
    src, tgt = int(math.sqrt(abs_pos.shape[0])), int(math.sqrt(tokens))
    if src == tgt:
        return abs_pos
    grid = abs_pos.float().reshape(1, src, src, -1).permute(0, 3, 1, 2)
    out = nn.functional.interpolate(grid, size=(tgt, tgt), mode="bicubic", align_corners=False)
    return out.permute(0, 2, 3, 1).flatten(0, 2).to(abs_pos.dtype)


def _sincos_2d(embed_dim: int, grid_size: int) -> np.ndarray:
    """visual.get_2d_sincos_pos_embed (MAE's): half the channels encode h, half w."""

    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float32) / (dim / 2.0)
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    gh = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(gh, gh), axis=0).reshape([2, 1, grid_size, grid_size])  # w goes first
    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)


class _VisualAttention(nn.Module):
    """visual.VisualAttention: one in_proj whose output is per head [q, k, v], batch first here."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        mixed = self.in_proj(x).view(b, s, self.heads, 3 * self.head_dim)
        q, k, v = mixed.split(self.head_dim, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        scores = torch.matmul(q / math.sqrt(self.head_dim), k.transpose(-2, -1))
        ctx = torch.matmul(scores.softmax(dim=-1), v)
        return self.out_proj(ctx.transpose(1, 2).reshape(b, s, -1))


class _VisualBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _VisualAttention(dim, heads)
        width = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(
            OrderedDict(
                [("c_fc", nn.Linear(dim, width)), ("gelu", nn.GELU()), ("c_proj", nn.Linear(width, dim))]
            )
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Transformer(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList([_VisualBlock(dim, heads, mlp_ratio) for _ in range(layers)])

    def forward(self, x):
        for block in self.resblocks:
            x = block(x)
        return x


class _Resampler(nn.Module):
    """visual.Resampler: grid² learned queries cross-attend (nn.MultiheadAttention) to the projected patches."""

    def __init__(self, grid_size: int, embed_dim: int, num_heads: int, kv_dim: int) -> None:
        super().__init__()
        self.num_queries = grid_size**2
        self.pos_embed = nn.Parameter(
            torch.from_numpy(_sincos_2d(embed_dim, grid_size)).float(), requires_grad=False
        )
        self.query = nn.Parameter(torch.zeros(self.num_queries, embed_dim))
        self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False) if kv_dim != embed_dim else nn.Identity()
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.ln_q = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ln_kv = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x):
        pos = _abs_pos(self.pos_embed, x.shape[1])
        x = self.ln_kv(self.kv_proj(x)).permute(1, 0, 2)  # [patches, images, dim]
        q = self.ln_q(self.query).unsqueeze(1).expand(-1, x.shape[1], -1)
        out = self.attn(q + self.pos_embed.unsqueeze(1), x + pos.unsqueeze(1), x, need_weights=False)[0]
        return out.permute(1, 0, 2)


class QwenVisual(nn.Module):
    """visual.VisionTransformer: pixel_values [images, 3, S, S] -> image_features [images, n_queries, output_dim]."""

    def __init__(self, visual: dict) -> None:
        super().__init__()
        width, patch = int(visual["width"]), int(visual["patch_size"])
        out = int(visual["output_dim"])
        n_queries = int(visual.get("n_queries", IMG_TOKEN_SPAN))
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch, stride=patch, bias=False)
        # visual.py builds a 256-row table and the published checkpoint's table is resized by get_abs_pos when
        # its size differs from the grid; the row count is the checkpoint's (pos_rows), 256 by default.
        self.positional_embedding = nn.Parameter(
            torch.randn(int(visual.get("pos_rows", 256)), width) * width**-0.5
        )
        self.ln_pre = nn.LayerNorm(width, eps=1e-6)
        self.transformer = _Transformer(
            width, int(visual["layers"]), int(visual["heads"]), float(visual["mlp_ratio"])
        )
        self.attn_pool = _Resampler(int(math.sqrt(n_queries)), out, out // 128, width)
        self.ln_post = nn.LayerNorm(out, eps=1e-6)
        self.proj = nn.Parameter(out**-0.5 * torch.randn(out, out))

    def forward(self, pixel_values):
        x = self.conv1(pixel_values)
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        x = self.ln_pre(x + _abs_pos(self.positional_embedding, x.shape[1]))
        x = self.attn_pool(self.transformer(x))
        return self.ln_post(x) @ self.proj


# ---------------------------------------------------------------- the whole model


class QwenVLForConditionalGeneration(nn.Module):
    """The native rebuild: ``visual`` (QwenVisual) + ``language_model`` (Qwen2ForCausalLM).

    forward/generate take ``input_ids`` whose image positions hold ``image_token_id`` (the runtime's layout:
    ``<img>`` + 256 pads + ``</img>``) and ``pixel_values``; the features replace those positions, as the remote
    model writes them over the 256 rows between ``<img>`` and ``</img>``.
    """

    def __init__(self, config: QwenVLConfig) -> None:
        super().__init__()
        from transformers import Qwen2ForCausalLM

        self.config = config
        self.visual = QwenVisual(config.visual)
        self.language_model = Qwen2ForCausalLM(qwen2_config(config))
        self.image_token_id = int(config.visual["image_start_id"]) + 2

    @classmethod
    def _from_config(cls, config):
        return cls(config)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_decoder(self):
        return self.language_model.model

    def get_output_embeddings(self):
        return self.language_model.lm_head

    def _embeds(self, input_ids, pixel_values):
        embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            feats = self.visual(pixel_values.to(embeds.dtype)).reshape(-1, embeds.shape[-1])
            # every row strictly between <img> and </img> (the remote code's hidden_states[i][a + 1 : b]), whatever
            # ids the prompt put there: pads (vlmc's layout) or the picture's path bytes (the remote processor's)
            start = input_ids == self.image_token_id - 2
            end = input_ids == self.image_token_id - 1
            inside = ((start.cumsum(-1) - end.cumsum(-1) > 0) & ~start) | (input_ids == self.image_token_id)
            embeds = embeds.masked_scatter(inside.unsqueeze(-1), feats)
        return embeds

    def forward(self, input_ids, attention_mask=None, pixel_values=None, **_):
        embeds = self._embeds(input_ids, pixel_values)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions)

    @torch.no_grad()
    def generate(
        self, input_ids, attention_mask=None, pixel_values=None, max_new_tokens=20, eos_token_id=None, **_
    ):
        """Greedy decoding with the KV cache (left-padded batches); returns prompt + new ids, as transformers'."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        embeds = self._embeds(input_ids, pixel_values)
        return native.greedy(self.language_model, embeds, mask, input_ids, max_new_tokens, eos_token_id)


# one Qwen block's tensors under Qwen2's names (model key inside ``model.layers.{i}.``) -> the hub's (inside
# ``transformer.h.{i}.``); q/k/v are the three row blocks of c_attn (weight and bias), in that order
_LAYER_NAMES = {
    "self_attn.o_proj.weight": "attn.c_proj.weight",
    "input_layernorm.weight": "ln_1.weight",
    "post_attention_layernorm.weight": "ln_2.weight",
    # QWenMLP: c_proj(w1(x) * silu(w2(x))) = down(up(x) * act(gate(x)))
    "mlp.gate_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.c_proj.weight",
}
_QKV = ("q", "k", "v")
_LM, _LAYERS = "language_model.", "language_model.model.layers."
_TOP_NAMES = {
    _LM + "model.embed_tokens.weight": "transformer.wte.weight",
    _LM + "model.norm.weight": "transformer.ln_f.weight",
    _LM + "lm_head.weight": "lm_head.weight",
}
# the resampler's 2-D sin-cos table: a frozen parameter, computed where a checkpoint leaves it out
_COMPUTED = "visual.attn_pool.pos_embed"


def hub_key(key: str, hidden: int) -> tuple[str, tuple[int, int] | None]:
    """Where this module's weight ``key`` is in the hub checkpoint: (checkpoint key, rows or None).

    ``transformer.visual.*`` is ``visual.*``; the Qwen blocks map onto Qwen2's (:data:`_LAYER_NAMES`), with
    ``q_proj`` / ``k_proj`` / ``v_proj`` the row blocks ``[0, h)``, ``[h, 2h)``, ``[2h, 3h)`` of ``c_attn``.
    """
    if key.startswith("visual."):
        return "transformer." + key, None
    if key in _TOP_NAMES:
        return _TOP_NAMES[key], None
    if key.startswith(_LAYERS):
        layer, rel = key[len(_LAYERS) :].split(".", 1)
        src = f"transformer.h.{layer}."
        if rel in _LAYER_NAMES:
            return src + _LAYER_NAMES[rel], None
        proj, kind = rel.rsplit(".", 1)
        if proj in (f"self_attn.{p}_proj" for p in _QKV):
            block = _QKV.index(proj[len("self_attn.")])
            return f"{src}attn.c_attn.{kind}", (block * hidden, (block + 1) * hidden)
    raise KeyError(key)


def to_hub_state_dict(model: QwenVLForConditionalGeneration) -> dict:
    """This model's weights under the hub checkpoint's names (the inverse of :func:`hub_key`; tests write narrow
    random-weight copies of the published repository with it)."""
    sd = model.state_dict()
    hidden = int(model.config.hidden_size)
    out, fused = {}, {}
    for key, t in sd.items():
        name, rows = hub_key(key, hidden)
        if rows is None:
            out[name] = t
        else:
            fused.setdefault(name, {})[rows[0]] = t
    for name, parts in fused.items():
        out[name] = torch.cat([parts[r] for r in sorted(parts)], dim=0)
    return {k: v.contiguous() for k, v in out.items()}


def _full_config(config, held: dict):
    """The config with the checkpoint's position-table row count (visual.py's table may differ from the grid)."""
    cfg = copy.deepcopy(config)
    pos = held.get("transformer.visual.positional_embedding")
    if pos is not None and pos.shape:
        cfg.visual["pos_rows"] = int(pos.shape[0])
    return cfg


def _load(path: Path, cfg, held: dict, built) -> QwenVLForConditionalGeneration:
    """Build ``built`` (a config, possibly cut in depth) on the meta device and load its weights from the checkpoint
    one tensor at a time (FP32), reading only the rows each weight is (q/k/v: their blocks of c_attn, checked
    against its 3 × hidden rows)."""
    hidden = int(cfg.hidden_size)

    def checkpoint_for(expected: dict):
        return native.mapped_checkpoint(
            path,
            held,
            expected,
            lambda key: hub_key(key, hidden),
            lambda _name: 3 * hidden,
            frozenset({_COMPUTED}),
        )

    model = native.load(
        path,
        QwenVLForConditionalGeneration,
        cfg,
        built,
        checkpoint_for,
        computed={_COMPUTED: lambda: _sincos_pos(cfg)},
    )
    model.language_model.config._attn_implementation = "eager"
    return model


def load_local(path: Path, config) -> QwenVLForConditionalGeneration:
    """Build the native model from a hub directory's config and safetensors weights (no repo code)."""
    check_supported(config, str(path))
    held = checkpoint.tensors(path)
    cfg = _full_config(config, held)
    return _load(path, cfg, held, cfg)


def load_reduced(path: Path, config):
    """The model with its two layer stacks (the ViT blocks and the decoder layers) cut to the streaming export's
    traced depth, for ``vlmc export`` / ``vlmc build`` (vlmc/exporters/streaming.py): the other layers' weights are
    streamed from the checkpoint into the stitched graphs, q/k/v as their rows of c_attn. Returns ``(model,
    full config)``, or None when neither stack is deeper than the trace."""
    check_supported(config, str(path))
    held = checkpoint.tensors(path)
    cfg = _full_config(config, held)
    traced = streaming.TRACED_LAYERS
    depths = {"lm": int(cfg.num_hidden_layers), "visual": int(cfg.visual["layers"])}
    if max(depths.values()) <= traced:
        return None
    reduced = copy.deepcopy(cfg)
    reduced.num_hidden_layers = min(depths["lm"], traced)
    reduced.visual["layers"] = min(depths["visual"], traced)
    model = _load(path, cfg, held, reduced)
    native.stream_stacks(
        model,
        [
            ("visual.transformer.resblocks", model.visual.transformer.resblocks, depths["visual"]),
            ("language_model.model.layers", model.language_model.model.layers, depths["lm"]),
        ],
    )
    return model, cfg


def _sincos_pos(cfg) -> torch.Tensor:
    out = int(cfg.visual["output_dim"])
    return torch.from_numpy(_sincos_2d(out, int(math.sqrt(int(cfg.visual.get("n_queries", IMG_TOKEN_SPAN))))))


# ---------------------------------------------------------------- export


def preprocess_facts(config) -> dict:
    """visual.py's image_transform: Resize((S, S), BICUBIC) on the PIL image, ToTensor, CLIP Normalize."""
    size = int(config.visual["image_size"])
    return {
        "kind": "resize",
        "size": [size, size],
        "mean": CLIP_MEAN,
        "std": CLIP_STD,
        "rescale_factor": 1 / 255,
        "resample": "bicubic",
    }


class VisionWrapper(nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.visual = model.visual

    def forward(self, pixel_values):
        return self.visual(pixel_values)


def export(source, pkg: Package) -> None:
    model, cfg = source.model, source.config
    check_supported(cfg, source.name)
    lm = model.language_model
    # the text config at full depth (a streamed source's model is cut to the traced layers; its config is whole)
    tcfg = qwen2_config(cfg)
    size = int(cfg.visual["image_size"])
    patch = int(cfg.visual["patch_size"])
    n_tokens = int(cfg.visual.get("n_queries", IMG_TOKEN_SPAN))

    m = pkg.manifest
    m["vision"] = {
        "image_size": [size, size],
        "tokens_per_image": n_tokens,
        "image_token_id": int(model.image_token_id),
        "preprocess": preprocess_facts(cfg),
        "patch_grid": [size // patch] * 2,
        "has_cls_token": False,
        "hidden_size": int(tcfg.hidden_size),
    }
    converted = None if source.directory is None else qwen_vl_tokenizer.from_directory(source.directory)
    ids = converted[1] if converted is not None else {}
    # generation_config.json's eos (<|endoftext|>) and make_context's chatml stop words (<|im_end|>, <|im_start|>)
    eos = [ids[t] for t in (ENDOFTEXT, IM_END, IM_START)] if ids else getattr(cfg, "eos_token_id", None)
    m["text"] = text_facts(
        cfg,
        tcfg,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=ids.get(ENDOFTEXT, getattr(cfg, "pad_token_id", None) or 0),
        max_positions=int(cfg.seq_length),
        prompt_template=CHATML_TEMPLATE,
        image_marker=IMAGE_MARKER,
        image_token=IMG_PAD,
        image_expansion=IMG_START + "{tokens}" + IMG_END,
        image_turn=IMAGE_TURN,
        image_row_ids="free",
        add_bos=False,
    )
    if converted is not None:
        if ids[IMG_PAD] != model.image_token_id:
            raise VlmcError(
                f"{source.name}: {qwen_vl_tokenizer.RANKS_FILE} gives {IMG_PAD} the id {ids[IMG_PAD]}, but "
                f"config.json's visual.image_start_id + 2 is {model.image_token_id}: they do not belong together"
            )
        pkg.files[processor.TOKENIZER_FILE] = converted[0].to_str().encode("utf-8")
        m["text"].update(
            tokenizer="source",
            tokenizer_file=processor.TOKENIZER_FILE,
            special_tokens={"eos_token": ENDOFTEXT},
        )
    m["kv"] = kv = kv_facts(tcfg)
    m["pipeline"] = {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}

    _, pixels = base.export_square_vision(pkg, VisionWrapper(model), size, "image_features")
    base.export_embed(pkg, lm.get_input_embeddings(), tcfg.vocab_size)
    base.export_decoder(
        pkg, lm.model, lm.lm_head, kv["layers"], kv["kv_heads"], kv["head_dim"], tcfg.hidden_size
    )


def reference_inputs(directory, manifest: dict, prompts: list[str], images: list[list]) -> dict:
    """What Qwen-VL-Chat's own code feeds its model (for `vlmc verify`), written with the tiktoken library as
    tokenization_qwen.py and qwen_generation_utils.make_context do: "Picture N: <img>REF</img>\\n" per picture
    (REF the picture's path, or "image N"), its bytes then <imgpad> up to 256 rows, the chatml turns; pixels as
    visual.py's image_transform (PIL bicubic to S², /255, CLIP mean/std)."""
    from PIL import Image

    try:
        import tiktoken
    except ModuleNotFoundError:
        raise VlmcError(
            "verify of a qwen_vl package needs the tiktoken library: pip install tiktoken"
        ) from None
    data = paths.model_bytes(directory, qwen_vl_tokenizer.RANKS_FILE)
    if data is None:
        raise VlmcError(f"{directory}: no {qwen_vl_tokenizer.RANKS_FILE}, so no reference tokenizer")
    ranks = qwen_vl_tokenizer.read_ranks(data)
    sp = qwen_vl_tokenizer.special_ids(len(ranks))
    enc = tiktoken.Encoding(
        "Qwen", pat_str=qwen_vl_tokenizer.PAT_STR, mergeable_ranks=ranks, special_tokens=sp
    )
    image_st = set(qwen_vl_tokenizer.SPECIAL_TOKENS[-9:])

    def encode(text: str) -> list[int]:
        ids = enc.encode(unicodedata.normalize("NFC", text), allowed_special=image_st, disallowed_special=())
        out, i = [], 0
        while i < len(ids):
            if ids[i] != sp[IMG_START]:
                out.append(ids[i])
                i += 1
                continue
            end = ids.index(sp[IMG_END], i)
            url = b"".join(enc.decode_single_token_bytes(t) for t in ids[i + 1 : end])
            out += [sp[IMG_START]] + list(url) + [sp[IMG_PAD]] * (IMG_TOKEN_SPAN - len(url)) + [sp[IMG_END]]
            i = end + 1
        return out

    nl = encode("\n")

    def turn(role: str, content: str) -> list[int]:
        return [sp[IM_START]] + encode(role) + nl + encode(content) + [sp[IM_END]]

    size = int(manifest["vision"]["image_size"][0])
    mean, std = np.array(CLIP_MEAN, np.float32), np.array(CLIP_STD, np.float32)
    seqs, pixels = [], []
    for prompt, per in zip(prompts, images):
        refs = [str(i) if isinstance(i, str) else f"image {n + 1}" for n, i in enumerate(per)]
        if IMAGE_MARKER in prompt:
            pieces = prompt.split(IMAGE_MARKER)
            query = pieces[0] + "".join(f"{IMG_START}{r}{IMG_END}{p}" for r, p in zip(refs, pieces[1:]))
        else:
            query = (
                "".join(f"Picture {n + 1}: {IMG_START}{r}{IMG_END}\n" for n, r in enumerate(refs)) + prompt
            )
        seqs.append(
            turn("system", SYSTEM) + nl + turn("user", query) + nl + [sp[IM_START]] + encode("assistant") + nl
        )
        for img in per:
            img = (Image.open(img) if isinstance(img, str) else img).convert("RGB")
            x = np.asarray(img.resize((size, size), Image.BICUBIC), np.float32) / 255.0
            pixels.append(((x - mean) / std).transpose(2, 0, 1))
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), sp[ENDOFTEXT], dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    for b, s in enumerate(seqs):  # left padding, as a decoder-only batch is generated
        ids[b, longest - len(s) :] = torch.tensor(s)
        mask[b, longest - len(s) :] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    if pixels:
        out["pixel_values"] = torch.from_numpy(np.stack(pixels))
    return out


# ---------------------------------------------------------------- the tiny built-in


def tiny_qwen_vl_config(**over) -> QwenVLConfig:
    """Qwen-VL-Chat's published structure (config.json of Qwen/Qwen-VL-Chat: 448² images, patch 14, 256 queries,
    mlp_ratio 4.9231, seq_length 2048, rotary base 10000, untied head), narrow: 2 layers each, a 256-wide LLM
    (the resampler has output_dim // 128 heads) and the byte tokenizer's vocabulary (the pad id is the tiny
    image token)."""
    kw = dict(
        vocab_size=zoo.TINY_VOCAB,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_channels=64,
        intermediate_size=512,
        layer_norm_epsilon=1e-6,
        rotary_emb_base=10000,
        rotary_pct=1.0,
        seq_length=2048,
        max_position_embeddings=8192,
        no_bias=True,
        initializer_range=0.2,
        visual={
            "heads": 4,
            "image_size": 448,
            "image_start_id": zoo.TINY_IMAGE_TOKEN - 2,
            "layers": 2,
            "mlp_ratio": 4.9231,
            "output_dim": 256,
            "patch_size": 14,
            "width": 64,
        },
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(over)
    return QwenVLConfig(**kw)


def build_tiny(config: QwenVLConfig | None = None) -> QwenVLForConditionalGeneration:
    """The tiny model with std-0.2 weights (scaled past width 64) and non-zero queries."""
    model = QwenVLForConditionalGeneration(config if config is not None else tiny_qwen_vl_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "visual.attn_pool.pos_embed":
                continue
            if p.dim() >= 2:
                # std 0.2 at the other built-ins' width 64, scaled by 1/sqrt(fan-in) past it: the 256-wide LLM's
                # logits stay as large as theirs, so float32 rounding stays far below verify's 1e-4 bound
                p.normal_(std=0.2 * min(1.0, (64 / p.shape[-1]) ** 0.5))
            elif name.endswith("bias"):
                p.normal_(std=0.05)
    return model.eval()


zoo.register_builtin("tiny-qwen-vl", "qwen_vl", build_tiny)
