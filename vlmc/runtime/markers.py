"""Image markers in prompt text: one fixed string (``<image>``) or a numbered one (Phi-3-V's ``<|image_N|>``).

``text.image_marker`` is the marker; one holding ``{n}`` is numbered: the prompt's markers must then be
``{n}`` = 1, 2, ... in the order they appear, one per image (the processor of Phi-3-vision checks that its
tags run from 1 without gaps, and gives image N's tokens to tag N; in order, each once, is the layout for
which the model's features, placed in position order, belong to their tags).
"""

from __future__ import annotations

import logging
import re

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

NUMBER = "{n}"


def numbered(marker: str) -> bool:
    return NUMBER in marker


def _pattern(marker: str) -> re.Pattern:
    head, tail = marker.split(NUMBER, 1)
    return re.compile(re.escape(head) + r"(\d{1,9})" + re.escape(tail))


def count(text: str, marker: str) -> int:
    """How many image markers the text holds."""
    return len(_pattern(marker).findall(text)) if numbered(marker) else text.count(marker)


def split(text: str, marker: str) -> list[str]:
    """The text between the markers (one more piece than markers); numbered markers are checked to run 1..N."""
    if not numbered(marker):
        return text.split(marker)
    pattern = _pattern(marker)
    found = [int(m) for m in pattern.findall(text)]
    if found != list(range(1, len(found) + 1)):
        shown = ", ".join(marker.replace(NUMBER, str(n)) for n in found[:6])
        raise VlmcError(
            f"image markers must be {marker.replace(NUMBER, '1')}, {marker.replace(NUMBER, '2')}, ... in order, "
            f"each once (one per image); the prompt has {shown}"
        )
    return pattern.split(text)[::2]


def nth(marker: str, n: int) -> str:
    """The marker of image ``n`` (1-based): the marker itself when it is not numbered."""
    return marker.replace(NUMBER, str(n))
