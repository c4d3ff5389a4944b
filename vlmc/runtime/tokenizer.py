"""Tokenizers for the runtime: the source's own (run with the `tokenizers` library) or the byte fallback.

A package exported from a directory with tokenizer files carries the tokenizer exactly as the source's
processor builds it in transformers (``text.tokenizer_file``, a `tokenizers` JSON), so `vlmc run` tokenizes
like the processor without transformers. Byte fallback (built-ins and sources without tokenizer files): id 0
pad, 1 bos, 2 eos, ``3 + b`` for byte ``b`` of the UTF-8 text; the manifest's image marker (``<image>``) maps
to the image token id.
"""

from __future__ import annotations

import logging

from vlmc import paths
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

BYTE_OFFSET = 3


class ByteTokenizer:
    source = False

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
    """The source processor's tokenizer, serialized by the exporter and run with `tokenizers` (no torch)."""

    source = True

    def __init__(self, json_text: str, image_token_id: int, marker: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ModuleNotFoundError as exc:
            raise VlmcError(
                "this package's tokenizer needs the tokenizers library: pip install tokenizers"
            ) from exc
        try:
            self.tok = Tokenizer.from_str(json_text)
        except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            raise VlmcError(
                f"the package's tokenizer (text.tokenizer_file) is not a valid tokenizers JSON ({first}); "
                "re-export the package"
            ) from None
        self.image_token_id = image_token_id
        self.marker = marker
        found = self.tok.token_to_id(marker)
        if found != image_token_id:
            raise VlmcError(
                f"the package's tokenizer maps the image marker {marker!r} to {found}, "
                f"not to vision.image_token_id {image_token_id}; re-export the package"
            )

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # add_special_tokens runs the tokenizer's own post-processor (BOS for Llama and OPT, nothing for
        # Qwen2), as the processor's tokenizer call does.
        return list(self.tok.encode(text, add_special_tokens=add_bos).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class TransformersTokenizer:
    """Packages from before text.tokenizer_file: the copied source files, loaded by transformers."""

    source = True

    def __init__(self, directory, image_token_id: int, marker: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ModuleNotFoundError as exc:
            raise VlmcError(
                "this package (exported by an older vlmc) tokenizes with transformers: "
                "pip install 'vlmc[export]', or re-export it so it runs with the tokenizers library alone"
            ) from exc
        # Loaded without the model's config.json, transformers may pick another tokenizer class than the
        # processor does (LlamaTokenizer rebuilds its pipeline from the legacy flag), so ids can differ.
        logger.warning(
            "this package was exported by an older vlmc: its tokenizer may not match the source processor's; "
            "re-export it (vlmc verify shows any difference)"
        )
        # The package's source/ is untrusted: its files are confined and bounded, and its own code never runs
        # (trust_remote_code=False: transformers neither runs nor asks about it, with or without a stdin).
        paths.model_files(directory)
        declared = paths.custom_code(directory)
        if declared:
            raise VlmcError(
                f"this package's tokenizer needs remote code (auto_map in source/{declared}), which vlmc "
                "does not run from a package; re-export it with this vlmc (the tokenizer is then a "
                "tokenizers JSON)"
            )
        try:
            self.tok = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
        except Exception as exc:  # transformers fails in its own ways on a damaged tokenizer
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            raise VlmcError(
                f"the package's source/ tokenizer cannot be loaded ({type(exc).__name__}: {first}); re-export it"
            ) from None
        self.image_token_id = image_token_id
        self.marker = marker

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=add_bos)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def package_text(pkg, name: str, key: str = "file") -> str | None:
    """A text file the package carries (saved in its directory, or still in memory after export).

    Read through the confinement rule (vlmc/paths.py): ``name`` must resolve inside the package.
    """
    if name in pkg.files:
        try:
            return pkg.files[name].decode("utf-8")
        except UnicodeDecodeError:
            raise VlmcError(f"{key} {name!r} is not UTF-8 text") from None
    if pkg.root is not None:
        where = str(pkg.root / "vlmc.json")
        if paths.inside(pkg.root, name, key, where).exists():
            return paths.read_text(pkg.root, name, key, where)
    return None


def load(pkg):
    text, vision = pkg.manifest["text"], pkg.manifest["vision"]
    # The token that stands for one image feature: text.image_token when the prompt's marker expands
    # into more than a run of it (text.image_expansion), else the marker itself.
    marker = text.get("image_token") or text.get("image_marker", "<image>")
    image_id = int(vision["image_token_id"])
    if text.get("tokenizer") == "source":
        if text.get("tokenizer_file"):
            data = package_text(pkg, text["tokenizer_file"], "text.tokenizer_file")
            if data is None:
                raise VlmcError(
                    f"the package has no {text['tokenizer_file']} (text.tokenizer_file); re-export it"
                )
            return SourceTokenizer(data, image_id, marker)
        if pkg.root is not None and (pkg.root / "source").is_dir():
            return TransformersTokenizer(pkg.root / "source", image_id, marker)
    return ByteTokenizer(
        int(text["vocab_size"]),
        image_id,
        marker,
        text.get("bos_token_id"),
        text.get("eos_token_id"),
    )
