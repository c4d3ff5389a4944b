"""Tokenizers for the runtime: the source's own (copied into the package) or the byte fallback.

Byte fallback (built-ins and sources without tokenizer files): id 0 pad, 1 bos, 2 eos, ``3 + b`` for
byte ``b`` of the UTF-8 text; the manifest's image marker (``<image>``) maps to the image token id.
"""

from __future__ import annotations

import logging

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

BYTE_OFFSET = 3


class ByteTokenizer:
    def __init__(self, vocab_size: int, image_token_id: int, marker: str, bos: int | None, eos) -> None:
        if vocab_size < BYTE_OFFSET + 256:
            raise VlmcError(
                f"the byte fallback tokenizer needs vocab_size >= 259 (model has {vocab_size}); "
                "export from a directory that has the model's tokenizer files"
            )
        self.image_token_id = image_token_id
        self.marker = marker
        self.bos = bos
        self.eos = eos

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self.bos] if add_bos and self.bos is not None else []
        for i, piece in enumerate(text.split(self.marker)):
            if i:
                ids.append(self.image_token_id)
            ids.extend(BYTE_OFFSET + b for b in piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")


class SourceTokenizer:
    """The model's own tokenizer, loaded with transformers from the package's source/ files."""

    def __init__(self, directory, image_token_id: int, marker: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ModuleNotFoundError as exc:
            raise VlmcError(
                "this package uses its source tokenizer, which needs transformers: pip install 'vlmc[export]'"
            ) from exc
        self.tok = AutoTokenizer.from_pretrained(str(directory))
        self.image_token_id = image_token_id
        self.marker = marker

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tok(text, add_special_tokens=add_bos)["input_ids"]
        if self.marker in text and self.image_token_id not in ids:
            raise VlmcError(
                f"the tokenizer does not map {self.marker!r} to the image token id {self.image_token_id}"
            )
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load(pkg):
    text, vision = pkg.manifest["text"], pkg.manifest["vision"]
    marker = text.get("image_marker", "<image>")
    if text.get("tokenizer") == "source" and pkg.root is not None and (pkg.root / "source").is_dir():
        return SourceTokenizer(pkg.root / "source", int(vision["image_token_id"]), marker)
    return ByteTokenizer(
        int(text["vocab_size"]),
        int(vision["image_token_id"]),
        marker,
        text.get("bos_token_id"),
        text.get("eos_token_id"),
    )
