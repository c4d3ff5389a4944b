"""Fidelity of a quantized package vs its FP32 self: per-graph outputs and end-to-end generation."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from vlmc import graphs, memory, metrics, ortsession
from vlmc.package import Package
from vlmc.runtime import Pipeline
from vlmc.runtime.executors.ort import OrtExecutor

logger = logging.getLogger(__name__)


LOGITS = "logits"  # the decoders' logits output (vlmc's graph interface)


_ELEMENTWISE = frozenset(
    {"Tanh", "Mul", "Div", "Add", "Sub", "Cast"}
)  # position-wise, with constant operands


def last_position(model: ir.Model) -> ir.Model | None:
    """A clone of a decoder whose ``logits`` output covers the last position only, or None.

    Fidelity needs the last position's logits (the pipeline reads ``logits[:, -1]``; per-graph fidelity
    compares what it reads), but a decoder's prefill computes the LM head over every prompt position:
    at the 512 M real-width LLaVA's 600-token prompt that MatMul ([600, 4096] x [4096, 32064]) is
    about 40% of the prefill, run for the FP32 reference, the per-graph and the end-to-end fidelity.
    Here the LM head's input gets a ``Slice`` to the last position (axis 1). The path from ``logits``
    back to that MatMul may pass through element-wise ops with constant operands (a softcap's
    Div/Tanh/Mul, a bias Add, a Cast), which work per position. Any other shape gives None (the
    caller keeps the whole graph). The weights are shared with ``model``, which is not changed.
    """
    work = model.clone()
    facts = graphs.slice_lm_head(work, LOGITS, _ELEMENTWISE, name="vlmc_last_position")
    return work if facts["sliced"] else None


def decoders(pkg: Package) -> set[str]:
    """The pipeline's decoder graphs with a ``logits`` output (those :func:`last_position` applies to)."""
    names = pkg.manifest.get("pipeline", {}).get("decoder", [])
    return {n for n in names if n in pkg.manifest["graphs"]}


class LastPosition(OrtExecutor):
    """onnxruntime on the package's graphs, the decoders' LM head on the last position only.

    What the generation loop reads is the same (``logits[:, -1]``); only the positions it never reads
    are not computed. Used by calibration's FP32 reference run and by the quantized fidelity runs, so
    the per-graph decoder fidelity compares last-position logits on both sides.
    """

    def __init__(self, pkg, threads: int | None = None) -> None:
        super().__init__(pkg, threads)
        self.sliced: set[str] = set()  # the graphs whose session computes the last position's logits only

    def _open(self, name: str, model: ir.Model):
        if self.pkg.info(name).get("precision") in ("int8_weight_only", "int4_weight_only"):
            return ortsession.dequantized(model, self.threads)
        return ortsession.from_model(model, self.threads, precision=self.pkg.info(name).get("precision"))

    def session(self, name: str):
        if name not in self.sessions:
            sliced = last_position(self.pkg.model(name)) if name in decoders(self.pkg) else None
            if sliced is not None:
                self.sessions[name] = self._open(name, sliced)
                self.sliced.add(name)
            else:
                self.sessions[name] = self._fallback(name)
        return self.sessions[name]

    def _fallback(self, name: str):
        return super().session(name)


class Sessions(LastPosition):
    """Sessions on the quantized graphs, shared by per-graph and end-to-end fidelity.

    Weight-only graphs run with each weight dequantized once (``ortsession.dequantized``) instead of
    per call: fidelity runs the decoder once per greedy token, and the per-call dequantization made
    that phase the slowest of the build (688 s of a 512 M-parameter build's quantize step). Decoders
    compute the last position's logits only (:class:`LastPosition`).
    """

    def session(self, name: str, alone: bool = False):
        """The session of graph ``name``; ``alone`` first drops the others (each holds its weights)."""
        if alone:
            for other in [k for k in self.sessions if k != name]:
                del self.sessions[other]
            memory.release_free()  # what the dropped sessions and the quantizer freed
        return super().session(name)

    def _fallback(self, name: str):
        if self.pkg.info(name).get("precision") in ("int8_weight_only", "int4_weight_only"):
            return ortsession.dequantized(self.pkg.model(name), self.threads)
        return ortsession.for_graph(self.pkg, name, self.threads)


def graph_fidelity(
    pkg: Package, name: str, feeds: list[dict], refs: list[dict], sessions: Sessions | None = None
) -> dict:
    """Worst cosine and max |Δ| per float output of a graph over the recorded (feeds, FP32 outputs)."""
    if not refs:
        return {}
    # Per-graph fidelity runs one graph at a time: the previous graph's session (and its weights)
    # need not stay resident beside this one's (end-to-end reopens what it needs).
    sessions = sessions or Sessions(pkg)
    sess = sessions.session(name, alone=True)
    names = [o.name for o in sess.get_outputs()]
    out: dict[str, dict] = {}
    for feed, ref in zip(feeds, refs):
        accumulate(out, ref, dict(zip(names, sess.run(None, _cast_feeds(sess, feed)))))
    if name in sessions.sliced and LOGITS in out:
        out[LOGITS]["positions"] = "last"  # both sides computed the last prompt position's logits only
    return out


def accumulate(out: dict, ref: dict, got: dict) -> None:
    """Fold one sample's outputs into ``out``: per float output, the worst cosine and max |Δ| so far."""
    for k, r in ref.items():
        if k not in got or r.dtype.kind != "f" or r.size == 0:
            continue
        g = got[k]
        c = metrics.cosine(r, g)
        d = metrics.max_abs_diff(r, g)
        e = out.setdefault(k, {"cosine": c, "max_abs_diff": d})
        e["cosine"], e["max_abs_diff"] = min(e["cosine"], c), max(e["max_abs_diff"], d)


def _cast_feeds(sess, feed: dict) -> dict:
    # A graph converted to fp16 without keep_io_fp32 takes float16 inputs.
    types = {"tensor(float16)": np.float16, "tensor(float)": np.float32}
    return {
        i.name: feed[i.name].astype(types.get(i.type, feed[i.name].dtype), copy=False)
        for i in sess.get_inputs()
    }


def end_to_end(
    pkg: Package, inputs: list, generations: list, tokens: int, sessions: Sessions | None = None
) -> dict:
    """First-token logits KL/cosine/top-1 and greedy common prefix of the package vs the FP32 run."""
    if not inputs:
        return {}
    pipe = Pipeline(pkg, executor=sessions or Sessions(pkg))
    kls, coss, top1, prefixes, diffs = [], [], [], [], []
    for inp, ref in zip(inputs, generations):
        got = pipe.generate_from(inp, max_new_tokens=tokens)
        c = metrics.generation_agreement(ref.prefill_logits, ref.tokens, got.prefill_logits, got.tokens)
        kls.append(c["kl"])
        coss.append(c["cosine"])
        top1.append(c["top1"])
        diffs.append(c["max_abs_diff"])
        prefixes.extend(c["common_prefix"])
    return {
        "samples": len(inputs),
        "new_tokens": tokens,
        "first_token_logits_kl": float(np.mean(kls)),
        "first_token_logits_cosine": float(np.mean(coss)),
        "first_token_logits_max_abs_diff": float(max(diffs)),
        "top1_agreement": float(np.mean(top1)),
        "greedy_common_prefix": prefixes,
        "greedy_common_prefix_mean": float(np.mean(prefixes)),
    }
