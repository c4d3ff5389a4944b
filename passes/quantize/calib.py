"""Calibration data for the quantize pass: graph feeds recorded from the FP32 package pipeline.

Every graph is calibrated on the inputs it sees in real use: calibration images (or built-in demo
images) and prompts go through the package's own FP32 pipeline, and the feeds of each graph (the
prefill call for decoders) are recorded. Graphs the pipeline does not run fall back to the
exporter's stored samples (vlmc.samples).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from vlmc import interrupts, ortsession, samples
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import Pipeline

from . import fidelity, stream_fidelity

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def image_files(directory: str) -> list[Path]:
    """Image files in a calibration directory (sorted), or a one-line VlmcError saying what is wrong."""
    d = Path(directory).expanduser()
    if not d.exists():
        raise VlmcError(
            f"calibration images directory {d} does not exist; point calibration.images at a "
            "directory of images, or omit it to use built-in demo images"
        )
    if not d.is_dir():
        raise VlmcError(f"calibration images {d} is not a directory")
    try:
        files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    except OSError as exc:
        raise VlmcError(f"calibration images directory {d} cannot be read ({exc.strerror})") from exc
    if not files:
        raise VlmcError(f"calibration images directory {d} has no images ({', '.join(IMAGE_SUFFIXES)})")
    return files


def image_refs(images: str | None, count: int, seed: int) -> list:
    """``count`` image references: files from the directory (cycled) or demo:SEED pictures."""
    if images is None:
        return [f"demo:{seed + i}" for i in range(count)]
    files = image_files(images)
    return [str(files[i % len(files)]) for i in range(count)]


@dataclass
class Recorded:
    """Feeds per graph (calibration), the FP32 outputs of the first few, and FP32 generations."""

    feeds: dict[str, list[dict[str, np.ndarray]]] = field(default_factory=dict)
    outputs: dict[str, list[dict[str, np.ndarray]]] = field(default_factory=dict)
    inputs: list = field(default_factory=list)  # pipeline Inputs of the eval samples
    generations: list = field(default_factory=list)  # fp32 GenerationResult per eval sample


class _Recorder:
    """Records each target graph's feeds (and optionally outputs) on its first call per sample."""

    def __init__(self, rec: Recorded, targets: set[str], outputs_of: set[str]) -> None:
        self.rec, self.targets, self.outputs_of = rec, targets, outputs_of
        self.keep_outputs = False
        self.seen: set[str] = set()

    def __call__(self, name: str, feeds: dict, outputs: dict) -> None:
        if name in self.targets and name not in self.seen:
            self.seen.add(name)
            self.rec.feeds[name].append({n: np.array(v) for n, v in feeds.items()})
            if self.keep_outputs and name in self.outputs_of:
                self.rec.outputs[name].append(outputs)


def record(
    pkg: Package,
    targets: set[str],
    images: list,
    prompts: list[str],
    eval_samples: int,
    eval_tokens: int,
    outputs_of: set[str] | None = None,
    feeds_only: set[str] = frozenset(),
    every_sample: set[str] | None = None,
) -> Recorded:
    """Run the FP32 pipeline on (prompt, image) pairs, one per sample, and record target feeds.

    The first ``eval_samples`` samples also keep the FP32 outputs of ``outputs_of`` (default: every
    target) and, when ``eval_tokens`` > 0, a greedy generation of that many tokens, which the pass
    compares the quantized package against. When no target is in the decoder chain (or is the embed
    graph) and no generation is asked for, only the image chain runs: no decoder session is opened.
    Graphs in ``feeds_only`` (too large for one session) have their feeds recorded but are not run
    whole: see :class:`_FeedsOnly`. Graphs in ``every_sample`` (default: every target; the calibrated
    ones) have their feeds recorded for every sample, the others for the fidelity samples only; a
    later sample whose remaining graphs are all in the image chain runs only that chain.
    """
    pipeline = pkg.manifest.get("pipeline", {})
    image_chain = set(pipeline.get("image", []))
    text_chain = set(pipeline.get("decoder", [])) | {pipeline.get("embed")}
    runnable = {t for t in targets if t in image_chain | text_chain}
    keep_outputs = targets if outputs_of is None else outputs_of
    rec = Recorded(feeds={t: [] for t in targets}, outputs={t: [] for t in targets})
    if runnable and pipeline.get("decoder"):
        image_only = not (runnable & text_chain) and eval_tokens <= 0
        later = runnable if every_sample is None else runnable & every_sample
        recorder = _Recorder(rec, runnable, keep_outputs)
        # Decoders compute the LM head on the last position only (fidelity.LastPosition), as the
        # quantized fidelity runs do: the generation reads nothing else.
        if feeds_only & runnable:
            executor = _FeedsOnly(pkg, feeds_only & runnable, recorder)
        else:
            executor = fidelity.LastPosition(pkg)
        pipe = Pipeline(pkg, on_graph=recorder, executor=executor)
        for i, ref in enumerate(images):
            interrupts.check()  # a Ctrl-C swallowed inside a sample's run stops the loop here
            keep = i < eval_samples
            recorder.seen.clear()
            recorder.keep_outputs = keep
            # Past the fidelity samples only the calibrated graphs' feeds are wanted: a 512 M LLaVA's
            # vision int8 calibration on 4 images then runs the FP32 decoder for 2 of them, not 4.
            recorder.targets = runnable if keep else later
            if not recorder.targets:
                break
            inp = pipe.prepare([prompts[i % len(prompts)]], [[ref]])
            if image_only or not (keep or later & text_chain):
                if inp.vision:
                    try:
                        _image_chain(pipe, recorder, pipeline["image"], inp.vision, keep)
                    except _Recorded:
                        pass  # every target's feeds of this sample are recorded
                continue
            # Only a graph's first call per sample (the prefill) is recorded; decode steps add nothing.
            try:
                gen = pipe.generate_from(inp, max_new_tokens=max(1, eval_tokens) if keep else 1)
            except _Recorded:
                continue  # every target's feeds of this sample are recorded
            if keep and eval_tokens > 0:
                rec.inputs.append(inp)
                rec.generations.append(gen)
        pipe.close()  # sessions hold a copy of every graph's weights; free them before quantizing
    for t in sorted(targets - runnable):
        logger.info("quantize: %s is not in the package pipeline; calibrating on stored/generated samples", t)
        wanted = eval_samples and t in keep_outputs and t not in feeds_only
        sess = ortsession.for_graph(pkg, t) if wanted else None
        for i in range(len(images)):
            feeds = samples.inputs_for(pkg, t, seed=i) if i else samples.inputs_for(pkg, t)
            rec.feeds[t].append(feeds)
            if sess is not None and i < eval_samples:
                rec.outputs[t].append(dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds))))
    return rec


class _Recorded(Exception):
    """Ends a calibration sample: every target's feeds are recorded and no output is needed."""


class _FeedsOnly(fidelity.LastPosition):
    """onnxruntime on the package's graphs, except ``large`` ones, which are never opened whole.

    A large graph's call records its feeds and ends the sample (a decoder's prefill is the last call
    a sample needs once generation is off) when every other target was seen; its outputs are then
    computed segment by segment over all samples at once (``stream_fidelity.reference``). When a
    target is still to come after it, this one call runs segment by segment instead.
    """

    def __init__(self, pkg: Package, large: set[str], recorder: _Recorder) -> None:
        super().__init__(pkg)
        self.large, self.recorder = large, recorder

    def inputs(self, graph: str) -> list[dict]:
        if graph not in self.large:
            return super().inputs(graph)
        return [{"name": v.name, "dtype": v.dtype.numpy().name} for v in self.pkg.model(graph).graph.inputs]

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if graph not in self.large:
            return super().run(graph, feeds)
        if self.recorder.targets - self.recorder.seen <= {graph}:
            self.recorder(graph, feeds, {})
            raise _Recorded
        return stream_fidelity.reference(self.pkg.model(graph), [feeds])[0]


def _image_chain(pipe: Pipeline, recorder: _Recorder, chain: list[str], vision: dict, keep: bool) -> None:
    """Run the image chain only as far as the recording needs, and record the targets' feeds.

    A graph runs when a later target needs its outputs as feeds, or when its own FP32 outputs are
    kept (the fidelity samples); a target after that only has its feeds recorded, since the feeds
    are all calibration needs. With the vision encoder alone calibrated on 4 images and 2 fidelity
    samples, 2 of the 4 FP32 forward passes of the encoder are left out (each one a whole CLIP
    ViT-L/14-336 at LLaVA-1.5-7B widths). The feeds recorded are the ones running would give.
    """
    wanted = [i for i, name in enumerate(chain) if name in recorder.targets]
    kept = [i for i in wanted if keep and chain[i] in recorder.outputs_of]
    last_run = max([max(wanted) - 1, *kept])
    env = pipe.vision_feeds(vision)
    for i, name in enumerate(chain[: max(wanted) + 1]):
        if i <= last_run:
            env.update(pipe.run_graph(name, env))
        elif name in recorder.targets and name not in recorder.seen:
            recorder.seen.add(name)
            recorder.rec.feeds[name].append({k: np.array(v) for k, v in pipe.graph_feeds(name, env).items()})


class FeedReader(CalibrationDataReader):
    """onnxruntime.quantization CalibrationDataReader over recorded feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = feeds
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self.feeds)
