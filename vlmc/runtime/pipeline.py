"""Greedy generation over a package's graphs, driven by the manifest's pipeline and facts.

The steps are the same for every family: preprocess images, run the image chain to
``image_features``, tokenize and expand image placeholders, embed, write image features into the
placeholder rows, compute positions, prefill, then decode one token at a time. What differs between
families (preprocessing kind, position kind, tokens per image, the graph chain) comes from vlmc.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

import numpy as np

from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import chat, deepstack, extras, markers, positions, preprocess
from vlmc.runtime import kv as kvmod
from vlmc.runtime import tokenizer as tokmod
from vlmc.runtime.executors.ort import Executor, OrtExecutor

logger = logging.getLogger(__name__)

_FLOAT_TYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}


@dataclass
class Inputs:
    """Everything one generation call feeds the graphs (numpy), also used to drive transformers in verify."""

    input_ids: np.ndarray  # [batch, seq] int64, left padded
    attention_mask: np.ndarray  # [batch, seq] int64
    vision: dict[str, np.ndarray] = field(default_factory=dict)  # pixel_values (+ image_grid_thw ...)
    image_counts: list[int] = field(default_factory=list)  # images per prompt
    # Extra inputs only the source transformers model needs (verify passes them), e.g. the
    # token-type ids named by the manifest's text.token_type_ids (1 on image placeholders, else 0).
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    # Every output of the image chain once prefill ran it (e.g. a pruned package's image_token_indices,
    # which M-RoPE positions need).
    image_outputs: dict[str, np.ndarray] = field(default_factory=dict)
    # Vision-graph rows per image when the preprocessing tiles images (vision.preprocess kind "tiles"):
    # each row gets tokens_per_image placeholders. None: one row per image.
    image_tiles: list[int] | None = None


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt (up to and including eos)
    texts: list[str]
    prefill_logits: np.ndarray  # [batch, vocab] logits of the last prompt position
    step_logits: list[np.ndarray] = field(default_factory=list)  # [batch, vocab] per generated token
    image_tokens: int = 0


class Pipeline:
    """Run a package: on onnxruntime CPU by default, or through another :class:`Executor`."""

    def __init__(
        self,
        pkg: Package,
        threads: int | None = None,
        on_graph=None,
        executor: Executor | None = None,
        decoder=None,
    ) -> None:
        """
        Args:
            pkg: the package to run (for a compile output, its runtime package: manifest and tokenizer).
            threads: onnxruntime intra-op threads (default: onnxruntime's).
            on_graph: ``on_graph(name, feeds, outputs)``, called after every graph run (calibration
                and fidelity code record activations through it).
            executor: what runs each graph (default: onnxruntime on the package's graphs). The loop
                is the same whatever runs the graphs (vlmc/runtime/executors/).
            decoder: runs the decoder step instead of the ``pipeline.decoder`` chain: one rank of a
                tensor-parallel package (:class:`vlmc.runtime.ranks.RankDecoder`), which also
                says which share of the KV heads the rank's cache holds.
        """
        self.pkg = pkg
        self.decoder = decoder
        self.m = pkg.manifest
        self.threads = threads
        self.on_graph = on_graph
        self.executor = executor if executor is not None else OrtExecutor(pkg, threads)
        self._sessions: dict[str, object] = getattr(self.executor, "sessions", {})
        self._tokenizer = None
        self._feed_plans: dict[str, tuple] = {}  # graph -> (its input list, names, float inputs): graph_feeds
        # An image-feature cache (the request scheduler's: get(key) / put(key, outputs)), keyed by the
        # preprocessed pixels and the preprocessing facts; None runs the image chain every time.
        self.image_cache = None

    def close(self) -> None:
        """Free what the executor holds (onnxruntime sessions hold a copy of their graph's weights)."""
        self.executor.close()

    # ---- sessions -------------------------------------------------------------------------
    def session(self, name: str):
        """The onnxruntime session of a graph (onnxruntime executor only)."""
        return self.executor.session(name)

    def run_graph(self, name: str, available: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one graph, feeding each declared input by name from ``available``."""
        feeds = self.graph_feeds(name, available)
        outs = self.executor.run(name, feeds)
        if self.on_graph is not None:
            self.on_graph(name, feeds, outs)
        return outs

    def graph_feeds(self, name: str, available: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The feeds :meth:`run_graph` gives graph ``name`` from ``available`` (calibration records them)."""
        specs = self.executor.inputs(name)
        plan = self._feed_plans.get(name)
        if plan is None or plan[0] is not specs:  # worked out once per input list (the loop asks every step)
            names = [spec["name"] for spec in specs]
            floats = [
                (spec["name"], _FLOAT_TYPES[spec["dtype"]]) for spec in specs if spec["dtype"] in _FLOAT_TYPES
            ]
            plan = self._feed_plans[name] = (specs, names, floats)
        _, names, floats = plan
        try:
            feeds = {iname: available[iname] for iname in names}
        except KeyError as exc:
            raise VlmcError(
                f"graph {name} needs input {exc.args[0]!r}, which the pipeline does not provide"
            ) from None
        # A graph converted to fp16 with its IO (quantize keep_io_fp32: false) takes float16 inputs. Only
        # arrays are cast: an executor's own objects (its pools, the KV it kept) carry its dtype already.
        for iname, want in floats:
            value = feeds[iname]
            if isinstance(value, np.ndarray) and value.dtype != want and value.dtype.kind == "f":
                feeds[iname] = value.astype(want)
        return feeds

    def run_chain(self, names: list[str], available: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run graphs in order; each one's outputs become available to the next (stage chains, decoder ranges)."""
        env = dict(available)
        produced: dict[str, np.ndarray] = {}
        for name in names:
            out = self.run_graph(name, env)
            env.update(out)
            produced.update(out)
        return produced

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = tokmod.load(self.pkg)
        return self._tokenizer

    # ---- inputs ----------------------------------------------------------------------------
    def tokens_for_images(
        self, vision: dict[str, np.ndarray], n_images: int, tiles: list[int] | None = None
    ) -> list[int]:
        """Placeholder count per image: fixed by the manifest (per tile when the preprocessing tiles images),
        or derived from the image grid."""
        v = self.m["vision"]
        grid = vision.get("image_grid_thw")
        if tiles is not None:
            if not isinstance(v.get("tokens_per_image"), int):
                raise VlmcError("a tiled package needs a fixed vision.tokens_per_image (tokens per tile)")
            return [int(v["tokens_per_image"]) * int(n) for n in tiles]
        if isinstance(v.get("tokens_per_image"), int):
            k = int(v["tokens_per_image"])
            if grid is not None and v.get("pruning"):
                # A pruned dynamic-resolution package keeps k of each image's tokens; it needs at least k.
                merge = int(v.get("spatial_merge_size", 1))
                for i, g in enumerate(grid):
                    if int(np.prod(g)) // (merge * merge) < k:
                        raise VlmcError(
                            f"image {i} gives {int(np.prod(g)) // (merge * merge)} visual tokens, fewer than "
                            f"the {k} this pruned package keeps per image; use a larger image"
                        )
            elif v.get("pruning"):
                # A pruned anyres package keeps k of each image's tokens (its size's count); it needs k.
                for i, n in enumerate(preprocess.token_counts(vision, v["preprocess"]) or []):
                    if n < k:
                        raise VlmcError(
                            f"image {i} gives {n} visual tokens, fewer than the {k} this pruned package "
                            "keeps per image; use a larger image"
                        )
            return [k] * n_images
        counts = preprocess.token_counts(vision, v["preprocess"])
        if counts is not None:
            return counts
        if grid is None:
            raise VlmcError("manifest gives no tokens_per_image and the preprocessing gives no image grid")
        merge = int(v.get("spatial_merge_size", 1))
        return [int(np.prod(g)) // (merge * merge) for g in grid]

    def render(self, prompt: str, n_images: int) -> tuple[str, bool]:
        """The text the processor tokenizes for one prompt, and whether special tokens (BOS) are added.

        A prompt with the image marker is used as given. A plain one goes through the source's chat
        template when the package has one (one user turn: its images, then the text); transformers then
        adds no BOS of its own if the rendered text starts with it. Otherwise the manifest's prompt_template.
        """
        t = self.m["text"]
        marker = t.get("image_marker", "<image>")
        add = bool(t.get("add_bos", True))
        if isinstance(prompt, list):
            return self._render_conversation(prompt, marker, add)
        if markers.count(prompt, marker):
            return prompt, add
        template = (
            tokmod.package_text(self.pkg, t["chat_template"], "text.chat_template")
            if t.get("chat_template")
            else None
        )
        if template is not None and self.tokenizer.source:
            text = chat.render(template, prompt, n_images, t.get("special_tokens"))
            bos = (t.get("special_tokens") or {}).get("bos_token")
            return text, add and not (bos and text.startswith(bos))
        template = _place_images(t, t.get("prompt_template", "{prompt}"), n_images)
        if not n_images:
            template = template.replace(marker, "")
        return template.replace("{prompt}", prompt), add

    def _render_conversation(self, messages: list[dict], marker: str, add: bool) -> tuple[str, bool]:
        """A conversation (transformers' message format): one user turn is the plain prompt it holds;
        more go through the chat template, or, for a package without one, each user turn becomes what
        its plain prompt would, followed by the other turns' text."""
        if len(messages) == 1 and messages[0]["role"] == "user":
            parts = messages[0]["content"]
            if isinstance(parts, str):
                return self.render(parts, 0)
            texts = [p["text"] for p in parts if p["type"] == "text"]
            images = [i for i, p in enumerate(parts) if p["type"] == "image"]
            if len(texts) == 1 and images == list(range(len(images))):  # images first: a plain prompt
                return self.render(texts[0], len(images))
        t = self.m["text"]
        n_images = sum(
            1
            for m in messages
            if isinstance(m["content"], list)
            for p in m["content"]
            if p["type"] == "image"
        )
        if t.get("chat_template") and self.tokenizer.source:
            template = tokmod.package_text(self.pkg, t["chat_template"], "text.chat_template")
            text = chat.render(template, messages, n_images, t.get("special_tokens"))
            bos = (t.get("special_tokens") or {}).get("bos_token")
            return text, add and not (bos and text.startswith(bos))
        # Without a template each user turn is laid out as a plain prompt is (text.prompt_template, its
        # images at the marker) and the other turns' text follows as it is, so a conversation's text
        # starts with the text of every earlier turn: the prefix its KV blocks are reused by.
        template = t.get("prompt_template", "{prompt}")
        out = []
        for m in messages:
            parts = (
                m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            )
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            if m["role"] != "user":
                out.append(text)
                continue
            n = sum(1 for p in parts if p["type"] == "image")
            if "{images}" in template:
                turn = _place_images(t, template, n)
            else:
                turn = template.replace(marker, marker * n) if marker in template else marker * n + template
            out.append(turn.replace("{prompt}", text))
        return "".join(out), add

    def prompt_ids(self, prompt: str | list[dict], counts: list[int]) -> list[int]:
        """Token ids of one prompt whose images give ``counts`` placeholders each.

        Like the processors, each marker is expanded into its placeholder run in the text *before*
        tokenizing, so the tokenizer sees exactly the string the processor gives it, whatever its
        normalizer or pre-tokenizer does at special-token boundaries.
        """
        t = self.m["text"]
        marker = t.get("image_marker", "<image>")
        image_id = int(self.m["vision"]["image_token_id"])
        text, add = self.render(prompt, len(counts))
        n_markers = markers.count(text, marker)
        if n_markers != len(counts):
            raise VlmcError(
                f"prompt has {n_markers} image placeholder(s) {marker!r} but {len(counts)} image(s) were given"
            )
        if t.get("tokenize_chunks"):
            # The processor tokenizes the text between the markers one piece at a time, each with its own
            # special tokens (Phi-3-V: a BOS before every piece), and puts each image's token run between them.
            pieces = markers.split(text, marker)
            ids = list(self.tokenizer.encode(pieces[0], add_bos=add))
            for n, piece in zip(counts, pieces[1:]):
                ids += [image_id] * n + list(self.tokenizer.encode(piece, add_bos=add))
        elif t.get("image_tokens_first"):
            # The processor tokenizes the placeholders of all images on their own (no special tokens) and
            # puts them ahead of the tokenized prompt (and its BOS); the marker only says an image is there.
            lead = self.tokenizer.encode(marker * sum(counts), add_bos=False) if counts else []
            ids = lead + self.tokenizer.encode(text.replace(marker, ""), add_bos=add)
        else:
            # Each marker becomes its run of image tokens, or, with text.image_expansion, the text the
            # processor puts there ("{tokens}" is the run; e.g. Gemma3's begin/end-of-image around it).
            image_token = t.get("image_token") or marker
            expansion = t.get("image_expansion") or "{tokens}"
            pieces = markers.split(text, marker)
            expanded = pieces[0] + "".join(
                expansion.replace("{tokens}", image_token * n) + piece for n, piece in zip(counts, pieces[1:])
            )
            ids = self.tokenizer.encode(expanded, add_bos=add)
        if sum(1 for x in ids if x == image_id) != sum(counts):
            raise VlmcError(
                f"the tokenizer does not map {t.get('image_token') or marker!r} to the image token id {image_id} "
                f"({sum(1 for x in ids if x == image_id)} placeholders for {sum(counts)} image tokens)"
            )
        vocab = int(t["vocab_size"])
        bad = next((x for x in ids if not 0 <= x < vocab), None)
        if bad is not None:
            raise VlmcError(
                f"the package's tokenizer gave token id {bad}, outside the vocabulary (text.vocab_size {vocab}); "
                "the tokenizer file does not belong to this model: re-export the package"
            )
        return ids

    def prepare(self, prompts: list[str], images: list[list]) -> Inputs:
        """Tokenize prompts, expand image placeholders, left-pad into a batch, preprocess images."""
        if len(prompts) != len(images):
            raise VlmcError(f"got {len(prompts)} prompts but {len(images)} image lists")
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, list):  # a conversation (the server's messages): its texts are checked
                continue
            if not isinstance(prompt, str):
                raise VlmcError(f"prompt #{i + 1} must be text, got {type(prompt).__name__}")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise VlmcError(
                    f"prompt #{i + 1} is not valid Unicode text (a lone surrogate at character {exc.start}); "
                    "pass UTF-8 text"
                ) from None
        t = self.m["text"]
        most = self.m["vision"]["preprocess"].get("max_images_per_prompt")
        if most is not None and any(len(per) > most for per in images):
            raise VlmcError(
                f"{self.m['model']['family']}: at most {most} image(s) per prompt (the processor lays out "
                "several images of one prompt differently, which this runtime does not reproduce)"
            )
        flat = [img for per in images for img in per]
        vision = preprocess.preprocess(flat, self.m["vision"]["preprocess"]) if flat else {}
        tiles = vision.pop(preprocess.TILES_KEY, None)
        tiles = None if tiles is None else [int(n) for n in tiles]
        counts = self.tokens_for_images(vision, len(flat), tiles) if flat else []
        image_id = int(self.m["vision"]["image_token_id"])
        seqs, k = [], 0
        for prompt, per in zip(prompts, images):
            seqs.append(self.prompt_ids(prompt, counts[k : k + len(per)]))
            k += len(per)
        longest = max(len(s) for s in seqs)
        limit = int(t.get("max_positions", 1 << 30))
        if longest >= limit:
            raise VlmcError(
                f"prompt is {longest} tokens (images included), longer than the model's context of {limit}; shorten the prompt or give fewer images"
            )
        pad = int(t.get("pad_token_id") or 0)
        ids = np.full((len(seqs), longest), pad, np.int64)
        mask = np.zeros((len(seqs), longest), np.int64)
        for b, s in enumerate(seqs):
            ids[b, longest - len(s) :] = s
            mask[b, longest - len(s) :] = 1
        extra = {}
        if t.get("token_type_ids"):
            extra[t["token_type_ids"]] = (ids == image_id).astype(np.int64)
        return Inputs(ids, mask, vision, [len(p) for p in images], extra, image_tiles=tiles)

    # ---- generation ------------------------------------------------------------------------
    def vision_feeds(self, vision: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The processor's vision inputs plus what the preprocessing kind derives from them for the
        graphs (e.g. anyres' image_feature_index / image_feature_weight), which the processor does not give."""
        return {**vision, **preprocess.graph_feeds(vision, self.m["vision"]["preprocess"])}

    def image_outputs(self, vision: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the image chain; all its outputs (image_features, plus e.g. image_token_indices)."""
        if self.image_cache is None:
            return self.run_chain(self.m["pipeline"]["image"], self.vision_feeds(vision))
        key = pixels_key(vision, self.m["vision"]["preprocess"])
        outputs = self.image_cache.get(key)
        if outputs is None:
            outputs = self.run_chain(self.m["pipeline"]["image"], self.vision_feeds(vision))
            self.image_cache.put(key, outputs)
        return outputs

    def image_features(self, vision: dict[str, np.ndarray]) -> np.ndarray:
        """Run the image chain; returns features flattened to [total_image_tokens, hidden]."""
        feats = self.image_outputs(vision)["image_features"]
        return feats.reshape(-1, feats.shape[-1])

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        return self.run_graph(self.m["pipeline"]["embed"], {"input_ids": input_ids})["inputs_embeds"]

    def prefill_embeds(self, inp: Inputs) -> np.ndarray:
        embeds = self.embed(inp.input_ids)
        slots = inp.input_ids == int(self.m["vision"]["image_token_id"])
        n_slots = int(slots.sum())
        if inp.vision:
            inp.image_outputs = self.image_outputs(inp.vision)
            feats = inp.image_outputs["image_features"]
            feats = feats.reshape(-1, feats.shape[-1])
            if feats.shape[0] != n_slots:
                raise VlmcError(
                    f"{n_slots} image placeholders but the vision graphs produced {feats.shape[0]} features"
                )
            embeds = embeds.copy()
            embeds[slots] = feats.astype(embeds.dtype)
        elif n_slots:
            raise VlmcError(f"{n_slots} image placeholders but no images")
        return embeds

    def _check_merged_slots(self, inp: Inputs) -> None:
        """The merged graph cannot report a placeholder/feature mismatch itself; check it before running."""
        n_slots = int((inp.input_ids == int(self.m["vision"]["image_token_id"])).sum())
        expected = sum(self.tokens_for_images(inp.vision, sum(inp.image_counts), inp.image_tiles))
        if n_slots != expected:
            raise VlmcError(f"{n_slots} image placeholders but the images give {expected} features")

    # ---- one step, shared by generate_from and the request scheduler (vlmc/runtime/scheduler.py) ----
    def eos_ids(self) -> set[int]:
        eos = self.m["text"].get("eos_token_id")
        return set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))

    def kv_facts(self) -> dict:
        """The KV facts this process's cache holds (one rank's share of the heads under tensor parallelism).

        Raises:
            VlmcError: a tensor-parallel package run without its ranks.
        """
        tp = self.m.get("tensor_parallel")
        if tp and self.decoder is None:
            raise VlmcError(
                f"the package is split over {tp['size']} ranks (tensor_parallel); run it with `vlmc run`, "
                "which starts the ranks, or vlmc.runtime.ranks.RankGroup"
            )
        return self.decoder.kv_facts(self.m["kv"]) if self.decoder is not None else self.m["kv"]

    def start(self, inp: Inputs):
        """What prefill needs: ``(merged graph or None, prompt embeds or None, position ids, extra inputs)``.

        A merged package (pipeline.vlm) prefills prompts that have images in one graph run: embedding,
        placeholder scatter and decoder all happen inside it (embeds is then None). Text-only prefill
        and every decode step use the embed + decoder chain, which merged packages keep beside it.
        """
        merged = self.m["pipeline"].get("vlm") if inp.vision else None
        embeds = self._check_merged_slots(inp) if merged else self.prefill_embeds(inp)
        ctx = {
            "manifest": self.m,
            "vision": inp.vision,
            "image_counts": inp.image_counts,
            "image_outputs": inp.image_outputs,
        }
        pos = positions.prefill(self.m["text"].get("position", "1d"), inp.input_ids, inp.attention_mask, ctx)
        return merged, embeds, pos, extras.prefill(self.m, inp.input_ids)

    def merged_inputs(self, inp: Inputs, merged: str, mask, pos, extra: dict) -> tuple[dict, list[str]]:
        available = {"attention_mask": mask, "position_ids": pos, **extra}
        available.update(self.vision_feeds(inp.vision), input_ids=inp.input_ids)
        return available, [merged]

    def decoder_inputs(self, embeds: np.ndarray, mask, pos, extra: dict) -> tuple[dict, list[str]]:
        available = {"attention_mask": mask, "position_ids": pos, "inputs_embeds": embeds, **extra}
        return available, self.m["pipeline"]["decoder"]

    def step(self, available: dict, chain: list[str], state) -> np.ndarray:
        """Run one prefill or decode step over ``state``'s KV; the last position's logits [batch, vocab]."""
        fed = available["inputs_embeds"] if "inputs_embeds" in available else available["input_ids"]
        available.update(
            state.feeds({"attention_mask": available["attention_mask"], "new_tokens": fed.shape[1]})
        )
        if self.decoder is not None and "inputs_embeds" in available:
            out = self.decoder.run(self, available)
        else:
            out = self.run_chain(chain, available)
        state.update(out)
        # A graph that computes part of its positions (merged pruned M-RoPE) returns the ones it used:
        # decode continues from those.
        used = self.m["graphs"].get(chain[-1], {}).get("positions_output")
        if used and used in out:
            available["position_ids"] = out[used]
        # a copy, not a view: a view kept the whole prefill logits ([batch, prompt, vocab]:
        # 77 MB at a 600-token LLaVA prompt) alive in step_logits for the result's life
        return out["logits"][:, -1, :].copy()

    def generate(self, prompts: list[str], images: list[list], max_new_tokens: int = 20) -> GenerationResult:
        return self.generate_from(self.prepare(prompts, images), max_new_tokens)

    def generate_from(self, inp: Inputs, max_new_tokens: int = 20) -> GenerationResult:
        if max_new_tokens < 1:
            raise VlmcError("max_new_tokens must be at least 1")
        t = self.m["text"]
        batch = inp.input_ids.shape[0]
        n, limit = int(inp.input_ids.shape[1]), int(t.get("max_positions", 1 << 30))
        if n + max_new_tokens > limit:
            # past the context a model computes what its graphs do not (Qwen-VL: dynamic NTK and logn attention
            # past seq_length), so generation never runs there; the same rule as the scheduler's
            raise VlmcError(
                f"the prompt ({n} tokens) and max_new_tokens {max_new_tokens} exceed the model's context of "
                f"{limit} tokens; give at most {max(limit - n, 0)} new tokens"
            )
        eos_ids = self.eos_ids()
        pad = int(t.get("pad_token_id") or 0)
        merged, embeds, pos, extra = self.start(inp)
        mask = inp.attention_mask
        dtype = self.m["kv"].get("dtype", "float32")
        state = kvmod.make(self.kv_facts(), batch, dtype, attention_mask=mask, pipeline=self)
        tokens: list[list[int]] = [[] for _ in range(batch)]
        done = np.zeros(batch, bool)
        step_logits = []
        prefill_logits = None
        try:
            for step in range(max_new_tokens):
                if embeds is None:
                    available, chain = self.merged_inputs(inp, merged, mask, pos, extra)
                else:
                    # text.deepstack (Qwen3-VL): vision-layer features for the image positions
                    ds = deepstack.feeds(
                        self.m, inp.input_ids, inp.image_outputs, embeds.shape[-1], step == 0
                    )
                    available, chain = self.decoder_inputs(embeds, mask, pos, {**extra, **ds})
                logits = self.step(available, chain, state)
                if prefill_logits is None:
                    prefill_logits = logits.copy()
                step_logits.append(logits)
                nxt = logits.argmax(-1)
                nxt = np.where(done, pad, nxt)
                for b in range(batch):
                    if not done[b]:
                        tokens[b].append(int(nxt[b]))
                        if int(nxt[b]) in eos_ids:
                            done[b] = True
                if done.all() or step == max_new_tokens - 1:
                    break
                embeds = self.embed(nxt[:, None].astype(np.int64))
                mask = np.concatenate([mask, np.ones((batch, 1), mask.dtype)], axis=1)
                pos = positions.next_positions(available["position_ids"])
                extra = extras.decode(self.m, nxt[:, None].astype(np.int64))
        finally:
            state.release()
        texts = [self.tokenizer.decode([x for x in seq if x not in eos_ids]) for seq in tokens]
        return GenerationResult(
            tokens,
            texts,
            prefill_logits,
            step_logits,
            image_tokens=int((inp.input_ids == int(self.m["vision"]["image_token_id"])).sum()),
        )


def pixels_key(vision: dict[str, np.ndarray], preprocess_facts: dict) -> str:
    """The images' identity for feature reuse: every preprocessed array (pixels, grids, tiles) and the
    preprocessing facts that made them."""
    digest = hashlib.sha256(json.dumps(preprocess_facts, sort_keys=True, default=str).encode())
    for name in sorted(vision):
        arr = np.ascontiguousarray(vision[name])
        digest.update(f"{name}:{arr.dtype.str}:{arr.shape}".encode())
        digest.update(arr.data)
    return digest.hexdigest()


def _place_images(text_facts: dict, template: str, n_images: int) -> str:
    """A template's ``{images}``: one ``text.image_turn`` per image, numbered from 1 (Qwen-VL's
    "Picture N: <img></img>\\n"; its marker is where the picture goes)."""
    if "{images}" not in template:
        return template
    turn = text_facts.get("image_turn") or text_facts.get("image_marker", "<image>")
    return template.replace("{images}", "".join(markers.nth(turn, i + 1) for i in range(n_images)))
