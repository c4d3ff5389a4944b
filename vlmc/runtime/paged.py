"""Paged KV for the reference runtime: a block allocator and the state that feeds paged decoder graphs."""

from __future__ import annotations

import logging
import re

import numpy as np

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Block 0 is never given to a sequence: unused block-table entries point at it (they are masked),
# and padding positions write their K/V into it (see docs/paged_kv.md, "Padding slots").
NULL_BLOCK = 0


class OutOfBlocks(VlmcError):
    """The pool has too few free blocks for a request."""


class BlockAllocator:
    """A pool of fixed-size KV blocks: a free list, one block table per sequence, release on finish.

    Args:
        num_blocks: blocks in the pool, including the reserved null block 0.
        block_size: tokens per block.
        seed: if given, the free list is shuffled with this seed (tests use it to get non-contiguous
            block tables); otherwise blocks are handed out in ascending order.
        growable: when the free list runs out, add blocks instead of failing (for pools whose size
            the graph leaves symbolic); the caller resizes its pool tensors to :attr:`num_blocks`.
    """

    def __init__(
        self, num_blocks: int, block_size: int, seed: int | None = None, growable: bool = False
    ) -> None:
        if num_blocks < 2:
            raise VlmcError(
                f"a KV pool needs at least 2 blocks (block {NULL_BLOCK} is reserved), got {num_blocks}"
            )
        if block_size < 1:
            raise VlmcError(f"block_size must be positive, got {block_size}")
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.growable = growable
        self._rng = np.random.default_rng(seed) if seed is not None else None
        # A stack: the last entry is handed out first.
        self._free: list[int] = self._ordered(range(NULL_BLOCK + 1, self.num_blocks))
        self._tables: dict[object, list[int]] = {}
        self._lengths: dict[object, int] = {}

    def _ordered(self, blocks) -> list[int]:
        blocks = list(blocks)
        if self._rng is not None:
            self._rng.shuffle(blocks)
            return blocks
        return blocks[::-1]

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list:
        return list(self._tables)

    def table(self, seq) -> list[int]:
        """The sequence's blocks in order (a copy)."""
        return list(self._tables.get(seq, []))

    def length(self, seq) -> int:
        """Tokens stored for the sequence."""
        return self._lengths.get(seq, 0)

    def block_tables(self, seqs: list, min_blocks: int = 1) -> np.ndarray:
        """int32 [len(seqs), max_blocks]; entries past a sequence's own blocks are the null block."""
        width = max([min_blocks] + [len(self._tables.get(s, [])) for s in seqs])
        out = np.full((len(seqs), width), NULL_BLOCK, np.int32)
        for r, s in enumerate(seqs):
            t = self._tables.get(s, [])
            out[r, : len(t)] = t
        return out

    # ---- allocation ------------------------------------------------------------------------
    def blocks_needed(self, seq, n_tokens: int) -> int:
        have = len(self._tables.get(seq, []))
        return max(0, -(-(self.length(seq) + n_tokens) // self.block_size) - have)

    def allocate(self, seq, n_tokens: int) -> np.ndarray:
        """Reserve room for the sequence's next ``n_tokens`` tokens; return their slots (int64).

        Raises:
            OutOfBlocks: not enough free blocks (nothing is allocated then).
        """
        need = self.blocks_needed(seq, n_tokens)
        self._ensure_free(need, f"sequence {seq!r} needs {need} more block(s)")
        table = self._tables.setdefault(seq, [])
        for _ in range(need):
            table.append(self._free.pop())
        start = self._lengths.get(seq, 0)
        pos = np.arange(start, start + n_tokens)
        self._lengths[seq] = start + n_tokens
        blocks = np.asarray(table, np.int64)[pos // self.block_size] if n_tokens else np.zeros(0, np.int64)
        return blocks * self.block_size + pos % self.block_size

    def release(self, seq) -> None:
        """Return a finished sequence's blocks to the free list."""
        blocks = self._tables.pop(seq, [])
        self._lengths.pop(seq, None)
        self._free.extend(reversed(blocks))

    def scratch_slots(self, n: int) -> np.ndarray:
        """``n`` distinct slots that no sequence owns (the null block first, then free blocks).

        Padding positions write their K/V here; nothing reads a scratch slot unmasked, and a block
        taken later by a sequence is written before its positions become visible.
        """
        blocks = [NULL_BLOCK] + self._free[::-1]
        if n > len(blocks) * self.block_size:
            self._ensure_free(len(self._free) + -(-n // self.block_size), f"{n} padding slots")
            blocks = [NULL_BLOCK] + self._free[::-1]
        slots = (
            np.asarray(blocks, np.int64)[:, None] * self.block_size + np.arange(self.block_size)
        ).reshape(-1)
        return slots[:n]

    def _ensure_free(self, need: int, what: str) -> None:
        if need <= len(self._free):
            return
        if not self.growable:
            raise OutOfBlocks(
                f"KV pool out of blocks: {what} but {len(self._free)} of {self.num_blocks} are free; "
                "raise num_blocks or run fewer/shorter sequences at once"
            )
        extra = max(need - len(self._free), self.num_blocks)  # double, so growth is amortized
        new = range(self.num_blocks, self.num_blocks + extra)
        self.num_blocks += extra
        self._free = self._ordered(new) + self._free


class PagedKV:
    """KV state for paged decoder graphs (manifest kv.layout == "paged").

    Each batch row is one sequence in a :class:`BlockAllocator`. Per step it feeds the pools
    ``key_cache.{i}``/``value_cache.{i}``, ``block_tables``, ``slot_mapping`` and ``context_lens``;
    the step's attention mask (left padding) says which new positions are real tokens.
    """

    def __init__(
        self,
        kv: dict,
        batch: int,
        dtype: str = "float32",
        attention_mask: np.ndarray | None = None,
        allocator: BlockAllocator | None = None,
        **_: object,
    ) -> None:
        self.layers = int(kv["layers"])
        self.kv_heads, self.head_dim = int(kv["kv_heads"]), int(kv["head_dim"])
        self.block_size = int(kv["block_size"])
        self.batch = batch
        fixed = kv.get("num_blocks")
        if allocator is None:
            if isinstance(fixed, int):
                allocator = BlockAllocator(fixed, self.block_size)
            else:
                tokens = int(attention_mask.sum()) if attention_mask is not None else 0
                width = attention_mask.shape[1] if attention_mask is not None else 1
                # Prompts plus one spare block per sequence plus the padding slots; grows if needed.
                guess = 1 + -(-(tokens + batch * width) // self.block_size) + batch
                allocator = BlockAllocator(guess, self.block_size, growable=True)
        if allocator.block_size != self.block_size:
            raise VlmcError(
                f"allocator block_size {allocator.block_size} != package kv.block_size {self.block_size}"
            )
        if isinstance(fixed, int) and allocator.num_blocks != fixed:
            raise VlmcError(
                f"the package's pool has {fixed} blocks but the allocator has {allocator.num_blocks}"
            )
        self.allocator = allocator
        self.seqs = [object() for _ in range(batch)]  # private ids: several states can share one allocator
        self.dtype = np.dtype(dtype)
        self.pools = {name: self._zeros(allocator.num_blocks) for name in self._pool_names()}

    def _pool_names(self) -> list[str]:
        return [f"{k}_cache.{i}" for i in range(self.layers) for k in ("key", "value")]

    def _zeros(self, n: int) -> np.ndarray:
        return np.zeros((n, self.block_size, self.kv_heads, self.head_dim), self.dtype)

    def feeds(self, step: dict) -> dict[str, np.ndarray]:
        """Allocate slots for this step's real tokens and return the paged inputs."""
        mask = np.asarray(step["attention_mask"])
        n = int(step["new_tokens"])
        new = mask[:, -n:] != 0
        slots = np.zeros((self.batch, n), np.int64)
        for b in range(self.batch):
            slots[b, new[b]] = self.allocator.allocate(self.seqs[b], int(new[b].sum()))
        n_pad = int((~new).sum())
        if n_pad:
            slots[~new] = -1 - self.allocator.scratch_slots(n_pad)
        ctx = np.array([self.allocator.length(s) for s in self.seqs], np.int32)
        if not np.array_equal(ctx, mask.sum(axis=1)):
            raise VlmcError(
                f"paged KV: cached lengths {ctx.tolist()} disagree with the attention mask "
                f"{mask.sum(axis=1).tolist()}"
            )
        self._resize()
        out = dict(self.pools)
        out.update(
            {
                "block_tables": self.allocator.block_tables(self.seqs),
                "slot_mapping": slots.astype(np.int32),
                "context_lens": ctx,
            }
        )
        return out

    def _resize(self) -> None:
        grow = self.allocator.num_blocks - next(iter(self.pools.values())).shape[0]
        if grow > 0:
            for name, pool in self.pools.items():
                self.pools[name] = np.concatenate([pool, self._zeros(grow)])

    def update(self, outputs: dict[str, np.ndarray]) -> None:
        for name in outputs:
            m = re.match(r"^(key|value)_cache_out\.(\d+)$", name)
            if m:
                self.pools[f"{m[1]}_cache.{m[2]}"] = outputs[name]

    def release(self) -> None:
        for s in self.seqs:
            self.allocator.release(s)
        self.pools.clear()
