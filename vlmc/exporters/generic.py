"""The generic exporter tier: one exporter for the VLMs that follow transformers 5's shared interface.

Most transformers 5 VLMs (``*ForConditionalGeneration``) expose the same pieces: ``get_image_features``
(returning a ``BaseModelOutputWithPooling`` whose ``pooler_output`` is the projected features, batched or a
per-image list), ``get_input_embeddings()``, ``get_decoder()`` (the text model, which takes
``inputs_embeds``, ``attention_mask``, ``position_ids`` and a ``cache=``) and ``get_output_embeddings()``
(the LM head). :func:`export` turns any such model into the three standard stage graphs
(``vision_encoder``, ``embed_tokens``, ``decoder``) and writes the manifest; everything that differs
between families is stated by a :class:`Family` object and lands in the manifest as facts, which the
runtime, the verifier, the passes and the backends read (none of them branches on the family name).

A family module on this tier keeps only what is truly its own:

- the processor's facts (``vision_facts``: preprocessing kind and settings, the token-count rule);
- prompt expansion and template (``text_facts``: marker, ``image_expansion``, chat layout);
- the position rule (``text_facts`` ``position`` and :attr:`Family.position_axes`);
- extra decoder inputs (:meth:`Family.decoder_inputs` and :meth:`Family.text_kwargs`);
- a vision module only when ``get_image_features`` cannot be traced for a dynamic image count
  (:meth:`Family.vision_trace`; e.g. LLaVA-NeXT's Python loop over image sizes).

The module then exports the tier's API with :func:`module_api` (``MODEL_TYPES``, ``ARCHITECTURES``,
``model_class``, ``export``, ``tokens_per_image``), and registers in ``vlmc.exporters.FAMILY_MODULES``.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field

import torch

from vlmc import samples
from vlmc.errors import VlmcError
from vlmc.exporters import base, streaming
from vlmc.exporters._facts import kv_facts, text_facts
from vlmc.package import Package

logger = logging.getLogger(__name__)


class ImageFeatures(torch.nn.Module):
    """pixel_values (+ the family's other vision inputs) -> image_features, through ``get_image_features``.

    ``pooler_output`` is the projected features: one tensor [images, tokens, hidden], or a per-image
    list, concatenated here to [image_tokens, hidden] (packed in image order).
    """

    def __init__(self, model, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs):
        out = self.model.get_image_features(**dict(zip(self.names, inputs)), return_dict=True)
        feats = out.pooler_output
        if isinstance(feats, (list, tuple)):
            feats = torch.cat(list(feats), dim=0)
        return feats


@dataclass
class VisionTrace:
    """How the vision graph is traced: the module, sample inputs, their names and dynamic axes.

    The graph's single output is always ``image_features``; ``output_axes`` are its dynamic axes
    ({0: images} for [images, tokens, hidden], {0: "image_tokens"} for packed features).
    """

    module: torch.nn.Module
    args: list
    input_names: list[str]
    input_axes: dict[str, dict[int, str]]
    output_axes: dict[int, str] = field(default_factory=lambda: {0: base.IMAGES})


class Family(abc.ABC):
    """What a family on the generic tier states. Subclass, set the class attributes, override the hooks.

    Attributes:
        name: the family name (``vlmc export --list``, ``model.family`` in the manifest).
        model_types: ``config.model_type`` values this family exports.
        architectures: the transformers classes (documentation and ``vlmc plan``).
        position_axes: None for 1-D positions [batch, seq]; 3 for M-RoPE [3, batch, seq] (and its
            interleaved variant: the layout of the ids is the same, the text model applies them).
    """

    name: str = ""
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    position_axes: int | None = None

    # ---- model ----------------------------------------------------------------------------
    def model_class(self, config=None):
        """The class ``load_source`` calls ``from_pretrained`` on (default: the image-text-to-text auto class)."""
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText

    def stream_depths(self, config) -> dict:
        """The layer stacks a streaming export cuts (vlmc/exporters/streaming.py), {(sub-config, field): Cut}.

        Default: the text decoder (by its ``layer_types``, when they differ), and the vision tower when
        the features are one layer's ``hidden_states[f]`` with f < 0 (:func:`streaming.feature_layer_depth`).
        A family whose tower reads its features otherwise states its own cut.
        """
        return {**streaming.decoder_depths(config), **streaming.feature_layer_depth(config)}

    # ---- facts ----------------------------------------------------------------------------
    @abc.abstractmethod
    def vision_facts(self, source) -> dict:
        """The manifest's ``vision`` section: at least ``image_token_id`` and ``preprocess`` (the runtime's
        preprocessing kind and settings), and either a fixed ``tokens_per_image`` or a token-count
        rule the preprocessing kind implements (``packed_features``: True, ``tokens_per_image``: None)."""

    def text_facts(self, source) -> dict:
        """The family's own entries of the manifest's ``text`` section (see _facts.text_facts): prompt
        template, image marker, ``image_expansion`` / ``image_token`` when the processor expands a marker
        into more than the image token, ``position``..."""
        return {}

    def tokens_per_image(self, config) -> int | None:
        """Image tokens per image for ``vlmc plan`` from a config alone (None: depends on the image size;
        plan then needs ``--image-size``, see :meth:`tokens_for_size`)."""
        return None

    def tokens_for_size(self, config, height: int, width: int, directory=None) -> int:
        """Image tokens of one image of this size (``vlmc plan --image-size``). Default: the fixed count."""
        n = self.tokens_per_image(config)
        if n is None:
            raise VlmcError(f"{self.name}: no token-count rule for an image size")
        return n

    # ---- graphs ---------------------------------------------------------------------------
    def vision_trace(self, model, config) -> VisionTrace:
        """The vision graph: by default ``get_image_features(pixel_values)`` on two square images."""
        v = config.vision_config
        size = int(v.image_size)
        pixels = torch.randn(2, int(getattr(v, "num_channels", 3)), size, size, generator=_gen())
        return VisionTrace(
            ImageFeatures(model, ["pixel_values"]),
            [pixels],
            ["pixel_values"],
            {"pixel_values": {0: base.IMAGES}, "image_features": {0: base.IMAGES}},
        )

    def decoder_inputs(self, config) -> list[base.DecoderInput]:
        """Extra decoder graph inputs (after position_ids), e.g. Gemma3's token_type_ids."""
        return []

    text_kwargs = None  # DecoderWrapper hook: extra inputs -> the text model's keyword arguments

    def after_export(self, source, pkg: Package, vision_graph) -> None:
        """Facts read off the exported vision graph (e.g. attention facts for prune); default none."""
        return None

    # ---- the exporter ---------------------------------------------------------------------
    def export(self, source, pkg: Package) -> None:
        export(self, source, pkg)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def layer_facts(text_config) -> dict:
    """Per-layer attention facts for the manifest's ``kv`` section when layers differ (sliding windows).

    Every layer's cache keeps the whole past in vlmc's graphs (see base.DecoderWrapper); ``layer_types``
    and ``sliding_window`` say which layers only attend to the last ``sliding_window`` positions, so a
    backend or a paged layout may size those layers' caches by the window.
    """
    types = list(getattr(text_config, "layer_types", None) or [])
    if "sliding_attention" not in types:
        return {}
    return {"layer_types": types, "sliding_window": int(text_config.sliding_window)}


def export(family: Family, source, pkg: Package) -> None:
    """Export a model of a generic-tier family: vision_encoder, embed_tokens and decoder, and the manifest."""
    model, cfg = source.model, source.config
    tcfg = cfg.get_text_config()
    m = pkg.manifest
    m["model"]["tier"] = "generic"
    vision = family.vision_facts(source)
    m["vision"] = {"hidden_size": int(tcfg.hidden_size), "attention": None, **vision}
    m["text"] = text_facts(cfg, tcfg, **family.text_facts(source))
    extras = family.decoder_inputs(cfg)
    if extras:
        m["text"]["decoder_inputs"] = {x.name: x.rule for x in extras}
    m["kv"] = kv = {**kv_facts(tcfg), **layer_facts(tcfg)}
    m["pipeline"] = {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}

    trace = family.vision_trace(model, cfg)
    axes = dict(trace.input_axes)
    axes["image_features"] = dict(trace.output_axes)
    graph = base.export_stage(
        pkg,
        "vision_encoder",
        trace.module,
        trace.args,
        trace.input_names,
        ["image_features"],
        axes,
        role="vision",
    )
    samples.store(pkg, "vision_encoder", {n: t.numpy() for n, t in zip(trace.input_names, trace.args)})
    family.after_export(source, pkg, graph)
    del graph
    base.export_embed(pkg, model.get_input_embeddings(), tcfg.vocab_size)
    base.export_decoder(
        pkg,
        model.get_decoder(),
        model.get_output_embeddings(),
        kv["layers"],
        kv["kv_heads"],
        kv["head_dim"],
        tcfg.hidden_size,
        position_axes=family.position_axes,
        extra_inputs=extras,
        text_kwargs=family.text_kwargs,
        softcap=getattr(tcfg, "final_logit_softcapping", None),
    )


def module_api(family: Family) -> dict:
    """The names a family module exposes to vlmc.exporters (``globals().update(generic.module_api(F))``)."""
    return {
        "FAMILY": family,
        "MODEL_TYPES": family.model_types,
        "ARCHITECTURES": family.architectures,
        "model_class": family.model_class,
        "export": family.export,
        "tokens_per_image": family.tokens_per_image,
        "stream_depths": family.stream_depths,
    }
