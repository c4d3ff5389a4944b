"""Qwen-VL's tiktoken vocabulary (qwen.tiktoken) as a `tokenizers` JSON, so the runtime tokenizes like QWenTokenizer.

QWenTokenizer (tokenization_qwen.py of Qwen/Qwen-VL-Chat, mirrored on GitHub in x1ngzai/Qwen-VL-Chat-Int4) is a
``tiktoken.Encoding`` over the BPE ranks of ``qwen.tiktoken`` (one ``base64(token) rank`` per line), its own split
pattern (single digits: ``\\p{N}``), the text NFC-normalized first, and 217 special tokens numbered from the rank
count in this order: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|extra_0..204|>``, then ``<ref>``,
``</ref>``, ``<box>``, ``</box>``, ``<quad>``, ``</quad>``, ``<img>``, ``</img>``, ``<imgpad>``. transformers'
``TikTokenConverter`` turns ranks into byte-level BPE merges; the ranks are read here (no tiktoken needed).
"""

from __future__ import annotations

import base64
import binascii
import logging
from pathlib import Path

from vlmc import paths
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

RANKS_FILE = "qwen.tiktoken"
PAT_STR = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (
    (ENDOFTEXT, IM_START, IM_END)
    + tuple(f"<|extra_{i}|>" for i in range(205))
    + ("<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>", "<img>", "</img>", "<imgpad>")
)


def read_ranks(data: bytes, where: str = RANKS_FILE) -> dict[bytes, int]:
    """tokenization_qwen._load_tiktoken_bpe: ``base64 rank`` per non-empty line; ranks must be 0..n-1."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        parts = line.split()
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (IndexError, ValueError, binascii.Error):
            raise VlmcError(f"{where}: line {number} is not 'base64-token rank'") from None
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise VlmcError(f"{where}: the ranks are not 0..{len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise VlmcError(f"{where}: not every single byte is a token (a byte-level BPE needs all 256)")
    return ranks


def convert(ranks: dict[bytes, int]):
    """The `tokenizers` Tokenizer equal to QWenTokenizer: byte-level BPE (TikTokenConverter), NFC, the specials."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_url):
            return ranks

    tok = _Converter(vocab_file=RANKS_FILE, pattern=PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != len(ranks) + i:
            raise VlmcError(f"{RANKS_FILE}: special token {t} did not get id {len(ranks) + i}")
    return tok


def special_ids(n_ranks: int) -> dict[str, int]:
    return {t: n_ranks + i for i, t in enumerate(SPECIAL_TOKENS)}


def from_directory(directory: Path):
    """(tokenizer, ids of the specials) from a hub directory's qwen.tiktoken, or None when it has none."""
    data = paths.model_bytes(directory, RANKS_FILE)
    if data is None:
        return None
    ranks = read_ranks(data, f"{directory}/{RANKS_FILE}")
    return convert(ranks), special_ids(len(ranks))
