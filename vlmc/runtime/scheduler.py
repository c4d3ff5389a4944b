"""Many requests on one paged package or build: continuous batching over one KV pool, prefix and image reuse.

Requests arrive and finish at different times. Each is prefilled on its own (batch 1, so its KV and first
token are what it would get run by itself), then joins the running batch: a step batches the running
sequences' decode tokens, up to ``max_batch``, into one decoder run. Every sequence has its own block
table in one :class:`~vlmc.runtime.paged.BlockAllocator` (block 0 stays the null block); a finished
sequence's blocks go back at once.

**Chunked prefill.** While sequences are decoding, a step prefills at most ``prefill_chunk`` prompt
tokens (whole blocks) of the requests it admitted, before its decode run, so a running sequence's next
token waits for one chunk, not for whole prompts; a long prompt takes several steps. A chunk is a
prefill over the KV its earlier chunks stored, as a cached prefix is, and ends on a block boundary.
A step that starts with no sequence decoding prefills what it admits whole (no one waits for a token).

Admission reserves, for each request, the blocks its prompt and ``max_new_tokens`` can take, so a
running sequence never waits for a block: while the pool cannot hold a request, it waits; a request
no empty pool could hold is refused with one line.

Reuse across requests (docs/serving.md):

- **prefix blocks.** Every whole block of a prompt (and, when the sequence ends, of its answer) is
  keyed by its tokens, the images whose placeholders it holds, and the key of the block before it, and
  stays in the pool after its sequence finishes (held by the cache, given back least recently used first when blocks run out). A new prompt
  that starts with cached blocks shares them by reference and prefills only the rest. Only whole
  blocks are shared, and a shared block is never written again (a sequence writes only to blocks it
  allocated itself), so no copy is ever needed.
- **image features.** The image chain's outputs are kept by the preprocessed pixels and preprocessing
  facts (``Pipeline.image_cache``), so a second turn about the same image does not run the vision graphs.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from vlmc.errors import VlmcError
from vlmc.runtime import deepstack, extras, positions
from vlmc.runtime.paged import BlockAllocator, PagedKV, PagedPool, _cache_dtype, pool_factory
from vlmc.runtime.pipeline import pixels_key

logger = logging.getLogger(__name__)

# A symbolic pool (kv.num_blocks "num_blocks") is sized to this many blocks unless told otherwise.
DEFAULT_POOL_BLOCKS = 1024
# Image-feature entries kept (each holds one request's image-chain outputs).
DEFAULT_IMAGE_CACHE = 16
# Prompt tokens a step prefills at most while other sequences decode (chunked prefill).
DEFAULT_PREFILL_CHUNK = 256


@dataclass
class Request:
    """One generation request, and what became of it.

    Attributes:
        prompt: the prompt text (with image markers, or plain: the chat template places the images).
        images: image sources (paths, ``demo:N``, PIL images or arrays), in placeholder order.
        max_new_tokens: tokens to generate at most.
        temperature: 0 is greedy; above 0 samples from softmax(logits / temperature) with ``seed``.
        stop_ids: extra token ids that end the request (the package's EOS always does).
        on_token: called as ``on_token(request, token)`` for every generated token (streaming).
    """

    prompt: str
    images: list = field(default_factory=list)
    max_new_tokens: int = 20
    temperature: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    on_token: object = None
    id: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (an EOS or stop id) or "length"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    submitted: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted


@dataclass(eq=False)  # a sequence is itself: list/deque membership and removal go by identity
class _Sequence:
    request: Request
    inputs: object  # the pipeline's Inputs for the prompt alone
    key: object = field(default_factory=object)  # the allocator's sequence id
    reserved: int = 0  # blocks admission set aside for it (prompt + max_new_tokens)
    next_pos: np.ndarray | None = None  # position ids of its next token ([1, 1] or [axes, 1, 1])
    rng: np.random.Generator | None = None
    prompt: list[int] = field(default_factory=list)  # prompt token ids
    image_keys: list[str] = field(default_factory=list)
    # Prefill in chunks: what Pipeline.start gave for the whole prompt, and the prompt tokens whose KV
    # is stored so far (a cached prefix included).
    start: tuple | None = None
    done: int = 0
    last_logits: np.ndarray | None = None  # the prompt's last position, until its first token is drawn


class _LRU:
    """A small least-recently-used map (image features)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: collections.OrderedDict = collections.OrderedDict()
        self.hits = 0

    def get(self, key):
        if key in self.items:
            self.items.move_to_end(key)
            self.hits += 1
            return self.items[key]
        return None

    def put(self, key, value) -> None:
        self.items[key] = value
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)


class PrefixCache:
    """Whole KV blocks of earlier prompts, by the key of their content and of everything before them.

    The cache holds each block it keeps (``BlockAllocator.hold``); a block only the cache holds is
    given back, least recently used first, when the allocator runs short (``reclaim``).
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.blocks: collections.OrderedDict[str, int] = collections.OrderedDict()
        allocator.reclaim = self.reclaim

    def lookup(self, keys: list[str]) -> list[int]:
        """The cached blocks of the longest run of ``keys`` from the start."""
        found = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            self.blocks.move_to_end(key)
            found.append(block)
        return found

    def insert(self, key: str, block: int) -> None:
        if key not in self.blocks:
            self.allocator.hold(block)
            self.blocks[key] = block

    def evictable(self) -> int:
        """Blocks only the cache holds: free for the asking."""
        return sum(1 for b in self.blocks.values() if self.allocator.holders(b) == 1)

    def reclaim(self, need: int) -> None:
        for key in [k for k, b in self.blocks.items() if self.allocator.holders(b) == 1][:need]:
            self.allocator.drop(self.blocks.pop(key))


def block_keys(ids: list[int], image_id: int, image_keys: list[str], block_size: int) -> list[str]:
    """The reuse key of every whole block of a prompt.

    A block's key hashes the previous block's key, its token ids and the identity of each image whose
    placeholders it holds (``image_keys`` in order of the placeholder runs), so equal keys mean equal
    KV rows for the whole prefix. A block may end inside an image's placeholders: the image's identity
    fixes the rest of its run too (its count, positions and features), so rows that attend forward
    within the image (an image block with bidirectional attention) saw the same tokens.
    """
    owner = np.full(len(ids), -1, np.int64)  # which image a placeholder belongs to
    arr = np.asarray(ids, np.int64)
    is_image = arr == image_id
    starts = np.flatnonzero(is_image & ~np.concatenate([[False], is_image[:-1]]))
    for k, start in enumerate(starts):
        end = start
        while end < len(arr) and is_image[end]:
            end += 1
        owner[start:end] = k
    keys, prev = [], ""
    for b in range(len(ids) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        digest = hashlib.sha256(prev.encode())
        digest.update(arr[lo:hi].tobytes())
        for k in sorted(set(owner[lo:hi].tolist()) - {-1}):
            digest.update(image_keys[k].encode() if k < len(image_keys) else b"?")
        prev = digest.hexdigest()
        keys.append(prev)
    return keys


class Scheduler:
    """Continuous batching of :class:`Request` s over one paged KV pool, for one :class:`Pipeline`.

    Args:
        pipeline: runs the package or build (any executor); its manifest must have ``kv.layout`` paged.
        max_batch: sequences decoded together at most (a build's largest batch gear at most).
        num_blocks: pool size for a package whose pool size is symbolic (a fixed ``kv.num_blocks`` is
            used as it is).
        prefix_cache: share whole prefix blocks between requests.
        image_cache: image-feature entries kept (0: none).
        prefill_chunk: prompt tokens a step prefills at most while sequences decode (rounded down to
            whole blocks, at least one); None prefills each admitted prompt whole in its step.
    """

    def __init__(
        self,
        pipeline,
        max_batch: int = 8,
        num_blocks: int | None = None,
        prefix_cache: bool = True,
        image_cache: int = DEFAULT_IMAGE_CACHE,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        m = pipeline.m
        if m["kv"].get("layout") != "paged":
            raise VlmcError(
                "serving many requests needs a paged package: run the paged_kv pass (recipes/paged.yaml), "
                "so every sequence has its own block table in one pool"
            )
        if max_batch < 1:
            raise VlmcError(f"max_batch must be at least 1, got {max_batch}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise VlmcError(f"prefill_chunk must be at least 1 token, got {prefill_chunk}")
        self.pipe = pipeline
        self.m = m
        self.kv = pipeline.kv_facts()
        self.block_size = int(self.kv["block_size"])
        fixed = self.kv.get("num_blocks")
        blocks = fixed if isinstance(fixed, int) else int(num_blocks or DEFAULT_POOL_BLOCKS)
        self.allocator = BlockAllocator(blocks, self.block_size)
        dtype = _cache_dtype(pipeline) or self.kv.get("dtype", "float32")
        self.pool = PagedPool(self.kv, self.allocator, dtype, pool_factory(pipeline))
        self.max_batch = int(max_batch)
        self.prefix = PrefixCache(self.allocator) if prefix_cache else None
        self.images = _LRU(image_cache) if image_cache else None
        pipeline.image_cache = self.images
        self.prefill_chunk = prefill_chunk
        # A chunk never ends inside an image's placeholders when they attend to each other both ways
        # (text.decoder_inputs' image_tokens rule): an earlier chunk's image rows would miss the later ones.
        self.whole_images = extras.images_attend_both_ways(m)
        self.waiting: collections.deque[_Sequence] = collections.deque()
        self.prefilling: collections.deque[_Sequence] = collections.deque()  # admitted, prompt not all in
        self.running: list[_Sequence] = []
        self._ids = itertools.count(1)
        self.eos = pipeline.eos_ids()
        self.steps = 0  # decoder runs of batched decode steps
        # Where the time goes (benchmarks and the server's stats): seconds and tokens of each phase.
        self.stats = {
            "prefill_seconds": 0.0,
            "prefills": 0,  # prompts completed
            "prefill_runs": 0,  # decoder runs of prefill (a chunked prompt takes several)
            "prefill_tokens": 0,  # prompt tokens computed (cached prefixes not counted)
            "decode_seconds": 0.0,
            "decode_tokens": 0,
        }
        self.image_id = int(m["vision"]["image_token_id"])
        self.limit = int(m["text"].get("max_positions", 1 << 30))

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue a request; its prompt is tokenized and its images preprocessed now.

        Raises:
            VlmcError: a bad prompt or image, or a request that no empty pool could hold.
        """
        inputs = self.pipe.prepare([request.prompt], [list(request.images)])
        n = int(inputs.input_ids.shape[1])
        if n + request.max_new_tokens > self.limit:
            raise VlmcError(
                f"the prompt ({n} tokens) and max_tokens {request.max_new_tokens} exceed the model's context "
                f"of {self.limit} tokens"
            )
        need = self._blocks_for(n + request.max_new_tokens)
        if need > self.allocator.num_blocks - 1:
            raise VlmcError(
                f"the request needs {need} KV blocks ({n} prompt tokens + {request.max_new_tokens} new, "
                f"{self.block_size} per block) but the pool has {self.allocator.num_blocks - 1}; "
                "lower max_tokens or give the pool more blocks"
            )
        request.id = request.id or next(self._ids)
        request.prompt_tokens = n
        request.submitted = time.perf_counter()
        seq = _Sequence(request, inputs, reserved=need)
        if request.temperature > 0:
            seq.rng = np.random.default_rng(request.seed)
        self.waiting.append(seq)
        return request

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def cancel(self, request: Request) -> None:
        """Stop a request wherever it is (its blocks go back at once)."""
        for seq in list(self.waiting):
            if seq.request is request:
                self.waiting.remove(seq)
        for seq in [*self.prefilling, *self.running]:
            if seq.request is request:
                self._finish(seq, "cancelled")

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit what fits, prefill (whole prompts, or one chunk's worth while sequences decode), then
        one batched decode step of every running sequence. Returns the requests that finished in this step."""
        finished: list[Request] = []
        decoding = bool(self.running)
        while (
            self.waiting
            and len(self.running) + len(self.prefilling) < self.max_batch
            and self._fits(self.waiting[0])
        ):
            self.prefilling.append(self.waiting.popleft())
        budget = None
        if decoding and self.prefill_chunk is not None:
            budget = max(self.prefill_chunk // self.block_size, 1) * self.block_size
        while self.prefilling and (budget is None or budget >= self.block_size):
            seq = self.prefilling[0]
            t0 = time.perf_counter()
            n = self._prefill(seq, budget)
            self.stats["prefill_seconds"] += time.perf_counter() - t0
            self.stats["prefill_runs"] += 1
            self.stats["prefill_tokens"] += n
            if budget is not None:
                budget -= n
            if seq.done < len(seq.prompt):
                continue  # the rest in later steps
            self.prefilling.popleft()
            self.running.append(seq)
            self.stats["prefills"] += 1
            self._first_token(seq)
            if seq.request.done:
                finished.append(seq.request)
        if self.running:
            t0, n = time.perf_counter(), len(self.running)
            finished += self._decode()
            self.stats["decode_seconds"] += time.perf_counter() - t0
            self.stats["decode_tokens"] += n
        return finished

    def run(self, requests: list[Request]) -> list[Request]:
        """Submit every request and step until all are done."""
        for r in requests:
            self.submit(r)
        while self.busy:
            self.step()
        return requests

    def _free_blocks(self) -> int:
        held = sum(
            seq.reserved - len(self.allocator.table(seq.key)) for seq in [*self.prefilling, *self.running]
        )
        spare = self.prefix.evictable() if self.prefix is not None else 0
        return self.allocator.num_free + spare - held

    def _fits(self, seq: _Sequence) -> bool:
        return seq.reserved <= self._free_blocks()

    def _begin(self, seq: _Sequence) -> None:
        """A sequence's first prefill: the whole prompt's embeds and positions, and any cached prefix."""
        pipe, inp = self.pipe, seq.inputs
        ids = seq.prompt = inp.input_ids[0].tolist()
        seq.image_keys = self._image_keys(inp)
        keys = block_keys(ids, self.image_id, seq.image_keys, self.block_size) if self.prefix else []
        # at least the prompt's last token is computed: its logits give the first new token
        shared = self.prefix.lookup(keys[: (len(ids) - 1) // self.block_size]) if keys else []
        merged, embeds, pos, extra = pipe.start(inp)
        cached = len(shared) * self.block_size
        if shared and embeds is None and (np.asarray(ids[cached:]) == self.image_id).any():
            shared, cached = [], 0  # a merged graph takes an image's tokens only with the whole prompt
        if shared:
            self.allocator.share(seq.key, shared, cached)
            if embeds is None:
                merged, embeds = None, pipe.embed(inp.input_ids)
        seq.request.cached_tokens = seq.done = cached
        seq.start = (merged, embeds, pos, extra)

    def _chunk_end(self, seq: _Sequence, budget: int | None) -> int:
        """Where this step's prefill of the sequence stops: the prompt's end, or a block boundary."""
        n, lo = len(seq.prompt), seq.done
        if budget is None or seq.start[1] is None:  # a merged graph takes a prompt with images whole
            return n
        hi = lo + budget // self.block_size * self.block_size  # the step leaves at least one block
        ids = seq.prompt
        while self.whole_images and lo < hi < n and ids[hi - 1] == self.image_id == ids[hi]:
            run = hi
            while run > lo and ids[run - 1] == self.image_id:
                run -= 1
            down = run // self.block_size * self.block_size
            if down > lo:
                hi = down  # before the image
            else:
                while run < n and ids[run] == self.image_id:
                    run += 1
                hi = -(-run // self.block_size) * self.block_size  # past it
        return min(hi, n)

    def _prefill(self, seq: _Sequence, budget: int | None) -> int:
        """Prefill the sequence's prompt up to this step's chunk end; returns the tokens computed.

        A chunk after the first is the same decoder run a cached prefix gets: its tokens, their
        positions of the whole prompt, over the KV the earlier chunks stored."""
        if seq.start is None:
            self._begin(seq)
        pipe, inp = self.pipe, seq.inputs
        merged, embeds, pos, extra = seq.start
        lo, hi = seq.done, self._chunk_end(seq, budget)
        mask = np.ones((1, hi), np.int64)
        state = PagedKV(self.kv, 1, pool=self.pool, seqs=[seq.key])
        if embeds is None:
            available, chain = pipe.merged_inputs(inp, merged, mask, pos, extra)
        else:
            part = {k: v[:, lo:hi] for k, v in extra.items()}
            outputs = _image_rows(self.m, inp, lo, hi)
            ds = deepstack.feeds(self.m, inp.input_ids[:, lo:hi], outputs, embeds.shape[-1], True)
            available, chain = pipe.decoder_inputs(embeds[:, lo:hi], mask, pos[..., lo:hi], {**part, **ds})
        logits = pipe.step(available, chain, state)
        seq.done = hi
        if hi == len(seq.prompt):
            seq.start = None
            self._remember(seq, seq.prompt)
            # from the whole prompt's positions (a merged graph's own, if it returns them)
            seq.next_pos = positions.next_positions(pos if embeds is not None else available["position_ids"])
            seq.last_logits = logits[0]
        return hi - lo

    def _first_token(self, seq: _Sequence) -> None:
        logits, seq.last_logits = seq.last_logits, None
        self._emit(seq, logits)

    def _image_keys(self, inp) -> list[str]:
        """One key per image of the request (placeholder-run order), for the prefix keys."""
        if not inp.vision:
            return []
        whole = pixels_key(inp.vision, self.m["vision"]["preprocess"])
        # The preprocessed arrays of a request's images are one batch; the images' own keys are the
        # batch key and their place in it (a repeat of the same images in the same order matches).
        return [f"{whole}:{k}" for k in range(sum(inp.image_counts))]

    def _decode(self) -> list[Request]:
        pipe, batch = self.pipe, self.running
        nxt = np.array([[seq.request.tokens[-1]] for seq in batch], np.int64)
        lengths = [self.allocator.length(seq.key) + 1 for seq in batch]
        mask = np.zeros((len(batch), max(lengths)), np.int64)
        for b, n in enumerate(lengths):
            mask[b, mask.shape[1] - n :] = 1
        pos = np.concatenate([seq.next_pos for seq in batch], axis=-2)
        embeds = pipe.embed(nxt)
        ds = deepstack.feeds(self.m, nxt, None, embeds.shape[-1], False)
        available, chain = pipe.decoder_inputs(embeds, mask, pos, {**extras.decode(self.m, nxt), **ds})
        state = PagedKV(self.kv, len(batch), pool=self.pool, seqs=[seq.key for seq in batch])
        logits = pipe.step(available, chain, state)
        self.steps += 1
        finished = []
        for b, seq in enumerate(list(batch)):
            seq.next_pos = seq.next_pos + 1
            self._emit(seq, logits[b])
            if seq.request.done:
                finished.append(seq.request)
        return finished

    def _emit(self, seq: _Sequence, logits: np.ndarray) -> None:
        r = seq.request
        if seq.rng is None:
            token = int(logits.argmax())
        else:
            z = logits.astype(np.float64) / r.temperature
            p = np.exp(z - z.max())
            token = int(seq.rng.choice(len(p), p=p / p.sum()))
        r.tokens.append(token)
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
        if r.on_token is not None:
            r.on_token(r, token)
        if token in self.eos or token in r.stop_ids:
            self._finish(seq, "stop")
        elif len(r.tokens) >= r.max_new_tokens:
            self._finish(seq, "length")

    def _remember(self, seq: _Sequence, ids: list[int]) -> None:
        """Keep the whole blocks holding ``ids`` (the sequence's stored tokens) in the prefix cache."""
        if self.prefix is not None:
            keys = block_keys(ids, self.image_id, seq.image_keys, self.block_size)
            for key, block in zip(keys, self.allocator.table(seq.key)):
                self.prefix.insert(key, block)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.request.finish_reason = reason
        seq.request.finished_at = time.perf_counter()
        # The answer's blocks too: a next turn's prompt starts with this prompt and this answer. Every
        # generated token but the last was fed back, so that is what the pool holds.
        if seq in self.prefilling:  # cancelled mid-prompt: nothing of it is kept
            self.prefilling.remove(seq)
        else:
            stored = self.allocator.length(seq.key)
            self._remember(seq, seq.prompt + seq.request.tokens[: stored - len(seq.prompt)])
            self.running.remove(seq)
        self.allocator.release(seq.key)

    def close(self) -> None:
        for seq in [*self.prefilling, *self.running]:
            self._finish(seq, "cancelled")
        self.waiting.clear()
        self.pipe.image_cache = None
        self.pool.clear()


def _image_rows(manifest: dict, inp, lo: int, hi: int) -> dict:
    """The image chain's outputs with only the deepstack rows of the image tokens in prompt positions
    [lo, hi) (a chunk, or what follows a cached prefix)."""
    ds = manifest["text"].get("deepstack")
    outputs = inp.image_outputs
    if not ds or not outputs or ds["vision_output"] not in outputs:
        return outputs
    image = inp.input_ids[0] == int(manifest["vision"]["image_token_id"])
    skip, take = int(image[:lo].sum()), int(image[lo:hi].sum())
    if (skip, take) == (0, int(image.sum())):
        return outputs
    if not take:  # no image token here: deepstack.feeds gives the text-only zero row
        return {k: v for k, v in outputs.items() if k != ds["vision_output"]}
    stack = np.asarray(outputs[ds["vision_output"]])
    stack = stack.reshape(int(ds["layers"]), -1, stack.shape[-1])[:, skip : skip + take]
    return {**outputs, ds["vision_output"]: stack}
