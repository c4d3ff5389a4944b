"""Paged KV for the reference runtime: a block allocator and the state that feeds paged decoder graphs."""

from __future__ import annotations

import logging
import operator
import re

import numpy as np

from vlmc import tensor_names
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Block 0 is never given to a sequence: unused block-table entries point at it (they are masked).
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
        # Holders of each handed-out block: its sequences (several when a prefix is shared) and any
        # extra holder such as the prefix cache (vlmc/runtime/scheduler.py). Free at zero.
        self._refs: dict[int, int] = {}
        # Called with the number of blocks wanted before the free list is declared too short: a
        # prefix cache gives back blocks only it still holds.
        self.reclaim = None

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
        if need:
            self._ensure_free(need, f"sequence {seq!r} needs {need} more block(s)")
        table = self._tables.setdefault(seq, [])
        for _ in range(need):
            block = self._free.pop()
            self._refs[block] = 1
            table.append(block)
        start = self._lengths.get(seq, 0)
        self._lengths[seq] = start + n_tokens
        if n_tokens == 1:  # a decode step: one slot, no arrays to build
            return np.array(
                [table[start // self.block_size] * self.block_size + start % self.block_size], np.int64
            )
        pos = np.arange(start, start + n_tokens)
        blocks = np.asarray(table, np.int64)[pos // self.block_size] if n_tokens else np.zeros(0, np.int64)
        return blocks * self.block_size + pos % self.block_size

    def release(self, seq) -> None:
        """Drop a finished sequence's hold on its blocks; a block no one else holds is free again."""
        blocks = self._tables.pop(seq, [])
        self._lengths.pop(seq, None)
        for block in reversed(blocks):
            self.drop(block)

    def share(self, seq, blocks: list[int], n_tokens: int) -> None:
        """Start a new sequence on blocks another holds (a shared prefix of ``n_tokens`` tokens, which
        fill the blocks): the sequence reads them, and writes only to blocks it allocates after them."""
        if seq in self._tables:
            raise VlmcError("paged KV: a shared prefix can only start a new sequence")
        if n_tokens != len(blocks) * self.block_size:
            raise VlmcError("paged KV: only whole blocks are shared")
        for block in blocks:
            self.hold(block)
        self._tables[seq] = list(blocks)
        self._lengths[seq] = n_tokens

    def hold(self, block: int) -> None:
        """One more holder of a handed-out block (it stays out of the free list until every holder drops it)."""
        if block not in self._refs:
            raise VlmcError(f"paged KV: block {block} is not in use")
        self._refs[block] += 1

    def drop(self, block: int) -> None:
        left = self._refs[block] - 1
        if left:
            self._refs[block] = left
        else:
            del self._refs[block]
            self._free.append(block)

    def holders(self, block: int) -> int:
        return self._refs.get(block, 0)

    def _ensure_free(self, need: int, what: str) -> None:
        if need > len(self._free) and self.reclaim is not None:
            self.reclaim(need - len(self._free))
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


def write_rows(pool: np.ndarray, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Store a step's rows in the pool in place: ``pool`` viewed as [slots, kv_heads, head_dim] gets
    ``rows`` [batch, seq, kv_heads, head_dim] at ``slot_mapping`` [batch, seq]; negative slots
    (padding) are skipped. This is the CPU counterpart of ATB ReshapeAndCache (docs/paged_kv.md).

    Raises:
        VlmcError: the pool is not C-contiguous (a reshape would copy, and the write would be lost),
            shapes disagree, or a slot lies outside the pool.
    """
    if not pool.flags.c_contiguous:
        raise VlmcError("paged KV: the pool must be C-contiguous to be written in place")
    slots = np.asarray(slot_mapping).reshape(-1)
    heads, dim = pool.shape[2], pool.shape[3]
    if rows.shape[:2] != np.shape(slot_mapping) or rows.shape[2:] != (heads, dim):
        raise VlmcError(
            f"paged KV: rows of shape {list(rows.shape)} do not match slot_mapping {list(np.shape(slot_mapping))} "
            f"and the pool's [{heads}, {dim}] rows"
        )
    live = slots >= 0
    flat = pool.reshape(-1, heads, dim)  # a view: the assignment below lands in the caller's pool
    if live.all():
        target, src = slots, rows.reshape(-1, heads, dim)
    else:
        target, src = slots[live], rows.reshape(-1, heads, dim)[live]
    if target.size and int(target.max()) >= flat.shape[0]:
        raise VlmcError(f"paged KV: slot {int(target.max())} is outside the pool of {flat.shape[0]} slots")
    flat[target] = src


class PagedPool:
    """The K/V pools of every layer and the allocator that shares them out: one per device pool.

    A :class:`PagedKV` state makes its own for one batch; the request scheduler
    (vlmc/runtime/scheduler.py) keeps one for its whole life and hands it to the state of every step,
    so sequences that join and leave a running batch all live in the same blocks.

    A pool is a numpy array, or an executor's pool object with ``write(rows, slot_mapping)``. Where an
    executor keeps every layer's pool in one stacked pool (vlmc/backends/ascend/stack_kv.py), its
    per-layer pools are ``parent``/``layer`` views of it; when a step's rows are likewise the layers
    of one stacked output (``parent``/``layer`` too) and the stacked pool has
    ``write_stack(rows_parent, slot_mapping)``, the step's rows of all layers are stored with that one
    call per K and V, instead of one per layer.
    """

    def __init__(self, kv: dict, allocator: BlockAllocator, dtype, new_pool=None) -> None:
        self.layers = int(kv["layers"])
        self.kv_heads, self.head_dim = int(kv["kv_heads"]), int(kv["head_dim"])
        self.block_size = int(kv["block_size"])
        if allocator.block_size != self.block_size:
            raise VlmcError(
                f"allocator block_size {allocator.block_size} != package kv.block_size {self.block_size}"
            )
        fixed = kv.get("num_blocks")
        if isinstance(fixed, int) and allocator.num_blocks != fixed:
            raise VlmcError(
                f"the package's pool has {fixed} blocks but the allocator has {allocator.num_blocks}"
            )
        if new_pool is not None and allocator.growable:
            raise VlmcError(
                "paged KV: an executor that holds the pools needs a fixed pool size (kv.num_blocks)"
            )
        self.allocator = allocator
        self.dtype = np.dtype(dtype)
        self._new_pool = new_pool
        names = [tensor_names.cache(i, k) for i in range(self.layers) for k in tensor_names.KV_KINDS]
        self.arrays = {name: self._pool(name, allocator.num_blocks) for name in names}
        # (pool name, rows name) of every layer, per K and V: what write() pairs every step.
        self._pairs = {
            k: [(tensor_names.cache(i, k), tensor_names.new_rows(i, k)) for i in range(self.layers)]
            for k in tensor_names.KV_KINDS
        }
        self._row_names = frozenset(r for pairs in self._pairs.values() for _, r in pairs)
        self._pools: list | None = None  # write(): per K and V (its pools, rows names, their stacked pool)

    def _zeros(self, n: int) -> np.ndarray:
        return np.zeros((n, self.block_size, self.kv_heads, self.head_dim), self.dtype)

    def _pool(self, name: str, n: int):
        if self._new_pool is not None:
            return self._new_pool(name, (n, self.block_size, self.kv_heads, self.head_dim), self.dtype)
        return self._zeros(n)

    def resize(self) -> None:
        """Grow the numpy pools to the allocator's size (a growable allocator added blocks)."""
        if not self.allocator.growable:
            return  # a fixed pool (every executor-held one) never grows
        grow = self.allocator.num_blocks - next(iter(self.arrays.values())).shape[0]
        if grow > 0:
            for name, pool in self.arrays.items():
                self.arrays[name] = np.concatenate([pool, self._zeros(grow)])
            self._pools = None

    def write(self, outputs: dict[str, np.ndarray], slots: np.ndarray) -> None:
        """Write a step's ``new_key.{i}``/``new_value.{i}`` rows into the pools at ``slots``.

        Raises:
            VlmcError: the graph returned no rows (a package from the earlier whole-pool interface,
                ``key_cache_out.{i}``: re-run paged_kv on the contiguous package).
        """
        missing = self._row_names - outputs.keys()
        if missing:
            written = 2 * self.layers - len(missing)
            old = any(_OLD_RE.match(name) for name in outputs)
            raise VlmcError(
                f"paged KV: the decoder returned {written} of {2 * self.layers} new_key/new_value outputs"
                + (
                    "; it has the earlier key_cache_out interface: re-run the paged_kv pass on the contiguous package"
                    if old
                    else ""
                )
            )
        if self._pools is None:  # per K and V: its pools, its rows' names, the stacked pool of its pools
            self._pools = []
            for pairs in self._pairs.values():
                pools = [self.arrays[p] for p, _ in pairs]
                self._pools.append((pools, [r for _, r in pairs], _one_stack(pools)))
        for pools, names, pool in self._pools:
            rows = [outputs[r] for r in names]
            src = None if pool is None else layers_of(rows)
            if src is not None and pool.write_stack(src, slots):
                continue  # every layer's rows in one call
            for layer_pool, layer_rows in zip(pools, rows):
                if isinstance(layer_pool, np.ndarray):
                    write_rows(layer_pool, layer_rows, slots)
                else:
                    layer_pool.write(layer_rows, slots)

    def clear(self) -> None:
        self.arrays.clear()
        self._pools = None


class PagedKV:
    """KV state for paged decoder graphs (manifest kv.layout == "paged", interface v2).

    Each batch row is one sequence in a :class:`BlockAllocator`. Per step it feeds the pools
    ``key_cache.{i}``/``value_cache.{i}`` (the same numpy arrays every step: onnxruntime reads
    them where they are), ``block_tables``, ``slot_mapping`` and ``context_lens``; the step's
    attention mask (left padding) says which new positions are real tokens. The graph returns
    ``new_key.{i}``/``new_value.{i}``, which :meth:`update` writes into the pools in place.

    Given a ``pool`` (and the rows' ``seqs``), the state feeds that shared pool and leaves its
    sequences to whoever owns the pool: :meth:`release` then frees nothing.
    """

    def __init__(
        self,
        kv: dict,
        batch: int,
        dtype: str = "float32",
        attention_mask: np.ndarray | None = None,
        allocator: BlockAllocator | None = None,
        pipeline: object | None = None,
        pool: PagedPool | None = None,
        seqs: list | None = None,
        **_: object,
    ) -> None:
        self.layers = int(kv["layers"])
        self.block_size = int(kv["block_size"])
        self.batch = batch
        self._owns = pool is None
        if pool is None:
            fixed = kv.get("num_blocks")
            if allocator is None:
                if isinstance(fixed, int):
                    allocator = BlockAllocator(fixed, self.block_size)
                else:
                    tokens = int(attention_mask.sum()) if attention_mask is not None else 0
                    # The prompts plus one spare block per sequence; grows (doubling) while decoding.
                    guess = 1 + -(-tokens // self.block_size) + batch
                    allocator = BlockAllocator(guess, self.block_size, growable=True)
            # The pools take the decoder's own cache dtype (float16 for a graph whose IO was converted):
            # a pool of another dtype would be cast, i.e. copied whole, by every step's feed. An
            # executor that keeps the pools itself (device memory on an NPU) hands them out; its pools
            # are written by their own write(rows, slots). Otherwise they are numpy arrays.
            pool = PagedPool(kv, allocator, _cache_dtype(pipeline) or dtype, pool_factory(pipeline))
        self.pool = pool
        self.allocator = pool.allocator
        self.dtype = pool.dtype
        # private ids: several states can share one allocator
        self.seqs = list(seqs) if seqs is not None else [object() for _ in range(batch)]
        self._slots: np.ndarray | None = None  # the last step's slot_mapping, for update()

    @property
    def pools(self) -> dict:
        return self.pool.arrays

    def feeds(self, step: dict) -> dict[str, np.ndarray]:
        """Allocate slots for this step's real tokens and return the paged inputs (padding slots are -1)."""
        mask = np.asarray(step["attention_mask"])
        n = int(step["new_tokens"])
        new = mask[:, -n:] != 0
        slots = np.full((self.batch, n), -1, np.int32)
        for b, count in enumerate(new.sum(axis=1).tolist()):
            got = self.allocator.allocate(self.seqs[b], count)
            if count == n:
                slots[b] = got  # every position real (a decode step): no mask to index by
            else:
                slots[b, new[b]] = got
        lengths = [self.allocator.length(s) for s in self.seqs]
        real = mask.sum(axis=1).tolist()  # compared as lists: a few rows, fewer numpy calls per step
        if lengths != real:
            raise VlmcError(f"paged KV: cached lengths {lengths} disagree with the attention mask {real}")
        ctx = np.array(lengths, np.int32)
        self.pool.resize()
        self._slots = slots
        out = dict(self.pools)
        out.update(
            {
                "block_tables": self.allocator.block_tables(self.seqs),
                "slot_mapping": self._slots,
                "context_lens": ctx,
            }
        )
        return out

    def update(self, outputs: dict[str, np.ndarray]) -> None:
        """Write the step's ``new_key.{i}``/``new_value.{i}`` rows into the pools at its slots."""
        self.pool.write(outputs, self._slots)

    def release(self) -> None:
        if not self._owns:
            return
        for s in self.seqs:
            self.allocator.release(s)
        self.pool.clear()


def _one_stack(pools: list):
    """The stacked pool when ``pools`` are layers 0..L-1 of one that has ``write_stack`` and covers
    exactly them (a step's rows, the same layers of one stacked output, are then stored in one call);
    else None."""
    pool = layers_of(pools)
    if pool is None or not hasattr(pool, "write_stack"):
        return None
    axis = getattr(pools[0], "axis", None)
    if axis is None or len(pools) != pool.shape[axis]:
        return None  # the stack holds other layers too (or fewer): layer by layer
    return pool


def layers_of(values: list):
    """The one ``parent`` that ``values`` are layers 0, 1, ... of, in order (an executor's per-layer
    views of one stacked pool or output: ``parent`` / ``layer``); None for anything else. In C-level
    loops (map, set): a 32-layer decoder checks 64 of them every step. A parent that lists the views it
    made (``views``, in layer order) is checked by identity against that list."""
    parent = getattr(values[0], "parent", None) if values else None
    views = getattr(parent, "views", None)
    if views is not None and len(views) == len(values) and all(map(operator.is_, values, views)):
        return parent
    try:
        parents = list(map(_PARENT, values))
        layers = list(map(_LAYER, values))
    except AttributeError:  # a numpy array among them
        return None
    if not parents or len(set(map(id, parents))) != 1 or layers != list(range(len(layers))):
        return None
    return parents[0]


_PARENT, _LAYER = operator.attrgetter("parent"), operator.attrgetter("layer")


def pool_factory(pipeline: object | None):
    """The executor's ``new_pool`` (device-held pools), or None for numpy pools."""
    return getattr(getattr(pipeline, "executor", None), "new_pool", None)


def _cache_dtype(pipeline: object | None) -> str | None:
    """The dtype the decoder's executor declares for key_cache.* (None without a pipeline or such input).

    Asked of the executor, not the manifest: a compile output's builds take float16 pools whatever
    the package's graphs declare (vlmc/backends/ascend/pools.py).
    """
    executor = getattr(pipeline, "executor", None)
    pkg = getattr(pipeline, "pkg", None)
    if pkg is None:
        return None
    # One rank of a tensor-parallel run asks its own segments: its executor holds no other rank's builds.
    decoder = getattr(pipeline, "decoder", None)
    names = decoder.graphs() if decoder is not None else pkg.manifest["pipeline"].get("decoder", [])
    for name in names:
        specs = executor.inputs(name) if executor is not None else pkg.info(name)["inputs"]
        for spec in specs:
            if spec["name"].startswith("key_cache."):
                return spec["dtype"]
    return None


_OLD_RE = re.compile(r"^(key|value)_cache_out\.(\d+)$")
