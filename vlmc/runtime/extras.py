"""Extra decoder inputs named by the manifest's ``text.decoder_inputs`` (graph input -> rule).

A family on the generic tier may give its decoder graph inputs beyond embeds, mask, positions and KV
(vlmc.exporters.base.DecoderInput); the manifest says how each is filled, so the runtime needs no family
knowledge:

- ``image_tokens``: [batch, new tokens] int64, 1 where the token is an image placeholder (Gemma3's
  ``token_type_ids``: image tokens attend to each other bidirectionally), 0 elsewhere; decoded tokens are
  text, so every decode step feeds zeros.
"""

from __future__ import annotations

import logging

import numpy as np

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)


def _image_tokens(manifest: dict, input_ids: np.ndarray) -> np.ndarray:
    return (input_ids == int(manifest["vision"]["image_token_id"])).astype(np.int64)


RULES = {"image_tokens": _image_tokens}


def _feeds(manifest: dict, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for name, rule in (manifest["text"].get("decoder_inputs") or {}).items():
        if rule not in RULES:
            raise VlmcError(
                f"unknown decoder input rule {rule!r} for {name!r} (text.decoder_inputs); known rules: "
                f"{', '.join(RULES)}; upgrade vlmc, or re-export the package with this one"
            )
        out[name] = RULES[rule](manifest, input_ids)
    return out


def images_attend_both_ways(manifest: dict) -> bool:
    """Whether the decoder lets an image's placeholders attend to each other in both directions (an
    ``image_tokens`` input): then a prefill cut inside an image's run would change its rows."""
    return "image_tokens" in (manifest["text"].get("decoder_inputs") or {}).values()


def prefill(manifest: dict, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The extra decoder inputs for a prefill of these (padded) prompt ids."""
    return _feeds(manifest, input_ids)


def decode(manifest: dict, new_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The extra decoder inputs for one decode step of ``new_ids`` [batch, 1]."""
    return _feeds(manifest, new_ids)
