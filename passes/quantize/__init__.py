"""quantize: mixed precision per graph (FP16, INT8 static QDQ, INT8/INT4 weight-only) in a portable form.

The result runs on onnxruntime at opset 17 (for parity checks) and is what the Ascend backend lowers
to AscendQuant/AscendDequant/NPUWeightQuantBatchMatmulV2. Everything lowering needs — mode, weight
dtype, per-channel axis, group size, activation scales and zero points by tensor, nodes kept in
FP32, clamped scales — is recorded in ``graphs[name]["quantization"]`` so it is never re-derived.
"""

from __future__ import annotations

import logging

from vlmc import graphs, interop, limits, manifest
from vlmc.errors import VlmcError
from vlmc.pass_api import Option, Pass, PassResult, register

from . import scheme, static, stream_fidelity, weight_only

logger = logging.getLogger(__name__)


@register
class Quantize(Pass):
    """Quantize graphs by a per-graph scheme; keys other than the options below are graph names or roles.

    Example recipe step::

        - quantize:
            vision_encoder: {weights: int8, activations: int8,
                             calibration: {images: samples/, count: 32, method: percentile}}
            decoder: {weights: fp16}
            keep_fp32: {op_types: [LayerNormalization, Softmax], nodes: ["/model/norm/*"]}
    """

    name = "quantize"
    summary = (
        "mixed precision per graph: fp16, int8 static (QDQ), int8/int4 weight-only (rtn/awq); "
        "portable opset-17 form with quantization facts in the manifest"
    )
    lossy = True
    # Every graph is built on a new model (weight-only edits a clone), so the snapshot stays FP32.
    changes_input = False
    requires = ("unmerged",)
    allow_extra_keys = True
    options = (
        Option(
            "keep_fp32",
            dict,
            None,
            "ops/nodes kept in float32 in every graph: {op_types: [...], nodes: [globs]}",
            fields=scheme.KEEP,
        ),
        Option(
            "calibration",
            dict,
            None,
            "default calibration for all graphs: "
            "{images: dir, prompts: [...], count: 32, method: minmax|percentile|entropy}",
            fields=scheme.CALIBRATION,
        ),
        Option(
            "eval_samples",
            int,
            2,
            "calibration samples also used to measure fidelity vs FP32",
            min=0,
            max=limits.MAX_CALIBRATION_SAMPLES,
        ),
        Option(
            "streamed_fidelity",
            bool,
            False,
            "measure per-graph fidelity of graphs above VLMC_MAX_FIDELITY_BYTES of FP32 weights segment "
            "by segment (one segment's weights in memory; costs a read of the FP32 and quantized graph "
            "and their prefill compute on eval_samples)",
        ),
        Option("eval_tokens", int, 8, "greedy tokens compared end to end vs FP32 (0: skip)", min=0, max=4096),
        Option("seed", int, 0, "seed for demo calibration images and sampling", min=0, max=2**32 - 1),
        Option(
            "target",
            str,
            "ascend",
            "backend the quantized graphs are built for: ascend keeps to the forms the NPU builds "
            "(symmetric int8 activations by default, per-tensor MatMul/Gemm weights, group sizes that "
            "NPUWeightQuantBatchMatmulV2 accepts); portable allows any form onnxruntime runs",
            choices=scheme.TARGETS,
        ),
    )

    # ---- options --------------------------------------------------------------------------
    @classmethod
    def _schemes(cls, opts: dict, where: str) -> dict[str, scheme.GraphScheme]:
        calibration = scheme.parse_calibration(opts.get("calibration"), f"{where}: calibration")
        keep = scheme.parse_keep(opts.get("keep_fp32"), f"{where}: keep_fp32")
        known = {o.name for o in cls.options}
        target = opts.get("target") or "ascend"
        return {
            k: scheme.parse_graph(k, v, where, calibration, keep, target)
            for k, v in opts.items()
            if k not in known
        }

    @classmethod
    def check_options(cls, opts: dict, where: str) -> None:
        if not cls._schemes(opts, where):
            raise VlmcError(
                f"{where}: name at least one graph to quantize, e.g. "
                "vision_encoder: {weights: int8, activations: int8} or decoder: {weights: int4}; "
                f"other options: {', '.join(o.name for o in cls.options)}"
            )

    @classmethod
    def json_schema(cls) -> dict:
        schema = super().json_schema()
        schema["additionalProperties"] = scheme.graph_schema()
        return schema

    def resolve(self, package) -> dict[str, scheme.GraphScheme]:
        """Graph name -> scheme. A key names a graph, or a role (all its graphs); graph names win."""
        schemes = self._schemes(self.opts, self.name)
        out: dict[str, scheme.GraphScheme] = {}
        for key, graph_scheme in schemes.items():
            if key in package.manifest["graphs"]:
                continue
            names = package.graphs_with_role(key)
            if not names:
                raise VlmcError(
                    f"quantize: the package has no graph or role {key!r}; graphs: "
                    f"{', '.join(package.graph_names)}; roles: "
                    f"{', '.join(r for r in manifest.ROLES if package.graphs_with_role(r))}"
                )
            out.update({n: graph_scheme for n in names})
        out.update({k: s for k, s in schemes.items() if k in package.manifest["graphs"]})
        return out

    def check_package(self, package) -> dict[str, scheme.GraphScheme]:
        """The scheme of every graph to quantize (graph name -> scheme): the plan ``run`` receives."""
        from . import calib  # onnxruntime.quantization: only when quantizing

        schemes = self.resolve(package)
        for name, graph_scheme in schemes.items():
            if graph_scheme.calibration.images is not None:
                calib.image_files(graph_scheme.calibration.images)
            if package.manifest.get("tensor_parallel") and (
                graph_scheme.needs_calibration or graph_scheme.mode == "int8"
            ):
                # Calibration runs the package in this process; a sharded one runs as rank processes.
                raise VlmcError(
                    f"quantize: {name} ({graph_scheme.mode}) needs calibration, which cannot run on a "
                    "tensor-parallel package; use rtn weight-only (int8/int4) after tensor_parallel, or fp16"
                )
        return {n: s for n, s in schemes.items() if s.mode != "fp32"}

    # ---- run ---------------------------------------------------------------------------------
    def run(self, package, plan=None):
        """Quantize every graph of ``plan`` (check_package's schemes; worked out here when run directly).

        Fidelity is measured here and reported by :meth:`evaluate`: the FP32 outputs are recorded
        before any graph changes, with the calibration runs, and each graph's feeds are freed as soon
        as it is measured, so the pass never holds more than one graph's samples.
        """
        from . import calib, fidelity  # onnxruntime (and its quantization tools): only when quantizing

        schemes = self.check_package(package) if plan is None else plan
        eval_samples, eval_tokens, seed = (
            self.opts["eval_samples"],
            self.opts["eval_tokens"],
            self.opts["seed"],
        )
        sharded = bool(package.manifest.get("tensor_parallel"))
        if sharded:  # fidelity runs the package in this process; a sharded one runs as rank processes
            eval_samples = eval_tokens = 0
        # What fidelity is measured (bounded by size and tokens: vlmc/limits.py), so only the feeds
        # and FP32 outputs it needs are recorded.
        fp32_bytes = {n: graphs.initializer_bytes(package.model(n)) for n in schemes}
        graph_eval, streamed, skipped = _graph_eval(
            schemes, fp32_bytes, eval_samples, self.opts["streamed_fidelity"]
        )
        e2e_tokens, e2e_note = _e2e_budget(package, eval_samples, eval_tokens, sharded)
        # One FP32 pipeline run per distinct calibration set, before any graph changes.
        groups: dict[tuple, list[str]] = {}
        for n, p in schemes.items():
            c = p.calibration
            groups.setdefault((c.images, c.prompts), []).append(n)
        recorded: dict[str, calib.Recorded] = {}
        e2e_source = None
        for (images, prompts), names in groups.items():
            calibrated = [n for n in names if schemes[n].needs_calibration or schemes[n].mode == "int8"]
            evaluated = [n for n in names if n in graph_eval]
            count = max([schemes[n].calibration.count for n in calibrated] or [0])
            wants_e2e = e2e_source is None and e2e_tokens > 0
            if evaluated or wants_e2e:
                count = max(count, eval_samples)
            if not count:
                continue
            refs = calib.image_refs(images, count, seed)
            rec = calib.record(
                package,
                set(calibrated) | set(evaluated),
                refs,
                list(prompts),
                eval_samples,
                e2e_tokens if wants_e2e else 0,
                outputs_of=set(evaluated) - streamed,
                feeds_only=streamed & set(evaluated),
                every_sample=set(calibrated),
            )
            for n in sorted(streamed & set(evaluated)):
                # Before any graph changes: the FP32 outputs, one segment's weights at a time.
                rec.outputs[n] = stream_fidelity.reference(package.model(n), rec.feeds[n][:eval_samples])
                if n in fidelity.decoders(package):  # compared at the last position: keep that one only
                    for out in rec.outputs[n]:
                        if fidelity.LOGITS in out:
                            out[fidelity.LOGITS] = out[fidelity.LOGITS][:, -1:].copy()
            if e2e_source is None and rec.generations:
                e2e_source = rec
            for n in names:
                recorded[n] = rec

        report: dict = {"graphs": {}}
        modified = False
        sessions = fidelity.Sessions(package)  # quantized sessions, reused by end-to-end fidelity
        for name, graph_scheme in schemes.items():
            rec = recorded.get(name)
            feeds = rec.feeds.get(name, []) if rec else []
            model = package.model(name)
            bytes_before = graphs.initializer_bytes(model)
            # New weights go to a scratch file as they are made, so the pass holds one at a time.
            scratch = package.scratch_path(name).parent
            model, facts = self._apply(model, graph_scheme, feeds, seed, scratch)
            weight_bytes = facts.pop("_weight_bytes", None)
            quantized = facts.get("nodes_quantized") or facts.get("nodes_converted")
            if not quantized:
                logger.warning(
                    "quantize: nothing to quantize in %s (%s); left unchanged", name, graph_scheme.mode
                )
                report["graphs"][name] = {
                    "mode": graph_scheme.mode,
                    "modified": False,
                    "reason": "no eligible nodes",
                    **_counts(facts),
                }
                continue
            if graph_scheme.needs_calibration or graph_scheme.mode == "int8":
                c = graph_scheme.calibration
                facts["calibration"] = {
                    "method": c.method if graph_scheme.mode == "int8" else "awq",
                    "samples": len(feeds),
                    "images": c.images or "demo",
                }
            package.set_graph(name, model, precision=graph_scheme.mode, quantization=facts)
            modified = True
            bytes_after = graphs.initializer_bytes(model)
            entry = {
                "mode": graph_scheme.mode,
                "modified": True,
                "bytes_before": bytes_before,
                "bytes_after": bytes_after,
                "bytes_ratio": round(bytes_after / max(bytes_before, 1), 4),
                **_counts(facts),
            }
            if weight_bytes:
                entry["matmul_weight_bytes_before"], entry["matmul_weight_bytes_after"] = weight_bytes
                entry["matmul_weight_bytes_ratio"] = round(weight_bytes[1] / max(weight_bytes[0], 1), 4)
            if name in skipped:
                entry["fidelity"] = skipped[name]
            elif rec is not None and name in streamed:
                entry["fidelity"], entry["fidelity_streamed"] = stream_fidelity.graph_fidelity(
                    model,
                    graph_scheme.mode,
                    feeds[:eval_samples],
                    rec.outputs.get(name, []),
                    last_position=name in fidelity.decoders(package),
                )
            elif rec is not None and name in graph_eval:
                entry["fidelity"] = fidelity.graph_fidelity(
                    package, name, feeds[:eval_samples], rec.outputs.get(name, []), sessions
                )
            report["graphs"][name] = entry
            if rec is not None:  # this graph's feeds and FP32 outputs are not read again: free them
                rec.feeds.pop(name, None)
                rec.outputs.pop(name, None)
            del feeds
        if modified and e2e_source is not None and e2e_tokens:
            report["end_to_end"] = fidelity.end_to_end(
                package, e2e_source.inputs, e2e_source.generations, e2e_tokens, sessions
            )
            if e2e_note:
                report["end_to_end"]["note"] = e2e_note
        elif modified and e2e_note and not sharded:
            report["end_to_end"] = e2e_note
        sessions.close()
        if sharded:
            report["end_to_end"] = (
                "not measured: a tensor-parallel package runs as rank processes; compare `vlmc run` "
                "with the unsharded package quantized the same way (docs/tensor_parallel.md)"
            )
        return PassResult(package, modified, report)

    def evaluate(self, before, after, result) -> dict | None:
        """The fidelity run measured against FP32: per graph, and end to end (None if nothing was)."""
        measured = {
            name: entry["fidelity"]
            for name, entry in result.report.get("graphs", {}).items()
            if isinstance(entry.get("fidelity"), dict)
        }
        out: dict = {"graphs": measured} if measured else {}
        if isinstance(result.report.get("end_to_end"), dict):
            out["end_to_end"] = result.report["end_to_end"]
        return out or None

    @staticmethod
    def _apply(model, graph_scheme: scheme.GraphScheme, feeds: list, seed: int, scratch):
        from . import calib  # onnxruntime.quantization: only when quantizing

        if graph_scheme.mode == "int8":
            if not feeds:
                raise VlmcError(
                    f"quantize: no calibration data for {graph_scheme.key}; give calibration.count ≥ 1"
                )
            return static.quantize_int8(model, calib.FeedReader(feeds), graph_scheme, seed, scratch)
        store = interop.TensorStore(scratch / "quantized.onnx.data")
        try:
            if graph_scheme.mode == "fp16":
                return static.convert_fp16(model, graph_scheme, store)
            # Weight-only rewrites the graph it is given: it gets a clone (the tensors are shared, not
            # copied), so the package's graph stays the FP32 one until set_graph replaces it.
            return weight_only.quantize_weight_only(model.clone(), graph_scheme, feeds, store)
        finally:
            store.close()


_FORCE = "raise VLMC_MAX_FIDELITY_BYTES (bytes) to measure it"
# How a graph above the limit is measured without holding it whole (a 7B decoder on a 24 GB machine).
_STREAM = "set quantize's option streamed_fidelity: true to measure it segment by segment"


def _graph_eval(
    schemes: dict, fp32_bytes: dict[str, int], eval_samples: int, stream: bool = False
) -> tuple[set[str], set[str], dict[str, str]]:
    """Graphs whose per-graph fidelity is measured, those of them measured segment by segment, and
    why the others are not (one line each).

    The whole-graph path records the FP32 outputs through an onnxruntime session on the FP32 graph and
    runs the quantized graph on another: above limits.MAX_FIDELITY_BYTES of FP32 weights that is more
    memory and time than the build itself. There ``stream`` (option ``streamed_fidelity``) runs
    both graphs segment by segment instead (``stream_fidelity``); without it the comparison is
    skipped and the report and the log say so and how to turn it on.
    """
    if not eval_samples:
        return set(), set(), {}
    limit = limits.MAX_FIDELITY_BYTES
    large = {n for n in schemes if fp32_bytes[n] > limit}
    if stream:
        return set(schemes), large, {}
    skipped = {}
    for n in sorted(large):
        skipped[n] = (
            f"not measured: {n} has {fp32_bytes[n] / 2**30:.2f} GiB of FP32 weights, above the "
            f"whole-graph fidelity limit of {limit / 2**30:.2f} GiB; {_STREAM} (one segment's weights "
            f"in memory), or {_FORCE} whole"
        )
        logger.warning("quantize: per-graph fidelity of %s %s", n, skipped[n])
    return set(schemes) - large, set(), skipped


def _e2e_budget(package, eval_samples: int, eval_tokens: int, sharded: bool) -> tuple[int, str]:
    """(greedy tokens per sample end-to-end fidelity generates, a note when it is cut or skipped)."""
    if sharded or not eval_samples or not eval_tokens:
        return 0, ""
    pipeline = package.manifest.get("pipeline", {})
    names = [*pipeline.get("image", []), pipeline.get("embed"), *pipeline.get("decoder", [])]
    names = [n for n in dict.fromkeys(names) if n and n in package.manifest["graphs"]]
    if not pipeline.get("decoder") or not names:
        return 0, ""
    total = sum(graphs.initializer_bytes(package.model(n)) for n in names)
    limit = limits.MAX_FIDELITY_BYTES
    if total > limit:
        note = (
            f"not measured: the pipeline's graphs have {total / 2**30:.2f} GiB of FP32 weights, above "
            f"the fidelity limit of {limit / 2**30:.2f} GiB; {_FORCE} where memory holds them all (it "
            "runs the decoder once per greedy token, so it is not streamed: that would read the decoder "
            "once per token)"
        )
        logger.warning("quantize: end-to-end fidelity %s", note)
        return 0, note
    budget = limits.MAX_FIDELITY_TOKENS
    if eval_samples * eval_tokens > budget:
        tokens = max(1, budget // eval_samples)
        note = (
            f"greedy tokens cut from {eval_tokens} to {tokens} per sample: {eval_samples} samples x "
            f"{eval_tokens} is above the token budget of {budget} (raise VLMC_MAX_FIDELITY_TOKENS)"
        )
        logger.warning("quantize: end-to-end fidelity %s", note)
        return tokens, note
    return eval_tokens, ""


def _counts(facts: dict) -> dict:
    q = facts.get("nodes_quantized")
    return {
        "nodes_quantized": len(q) if isinstance(q, list) else int(facts.get("nodes_converted") or 0),
        "nodes_kept_fp32": len(facts.get("nodes_kept_fp32", [])),
        "clamped_scales": len(facts.get("clamped_scales", [])),
    }
