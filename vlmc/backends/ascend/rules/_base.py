"""The rewrite-rule shape the Ascend lowering uses: match -> check -> rewrite, with reasons and counts.

Modelled on onnxscript's rewriter (pattern, check that gives a reason, replacement; a count of
rewrites per rule), but hand-written over onnx-ir: the rules read constant values (scales, integer
weights, recorded quantization facts) and emit Ascend ops in the default domain that no ONNX schema
knows, and every "no match" and "cannot lower" needs its own reason in compile.json. onnxscript's
rewriter reports neither and would be a new dependency for ~80 lines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from ._graph import Graph

logger = logging.getLogger(__name__)


@dataclass
class NoMatch:
    """Why a rule's pattern is not at a node (not an error: another rule may take it)."""

    reason: str


@dataclass
class Context:
    """What the rules share while lowering one graph."""

    graph: Graph
    name: str  # the graph's name, for messages
    facts: dict  # graphs[name]["quantization"] as the quantize pass recorded it ({} for foreign graphs)
    report: Any  # lower.LowerReport
    problems: list[str] = field(default_factory=list)
    quant_cache: dict[tuple, str] = field(default_factory=dict)  # one AscendQuant per (tensor, scale, zp)
    int4_weights: str = "int8"  # INT4 weight storage: "int8" (one per int8) or "int4" (ONNX INT4)

    def node_facts(self, node: ir.Node) -> dict | None:
        """The quantize pass's record for one node's weight, if it made one."""
        nodes = (self.facts.get("weights") or {}).get("nodes") or {}
        entry = nodes.get(node.name)
        return entry if isinstance(entry, dict) else None


@dataclass
class Rule:
    """One lowering rule.

    Attributes:
        name: short name (compile.json counts rewrites under it).
        anchors: op types a match starts from.
        source: where the target form is defined (repository and file), shown in docs/ascend.md.
        match: ``(ctx, node) -> match object | NoMatch``; finds the pattern, changes nothing.
        check: ``(ctx, match) -> None | reason``; a reason means the pattern is there but has no
            Ascend form, which is an error naming the node.
        rewrite: ``(ctx, match) -> None``; replaces the pattern.
    """

    name: str
    anchors: tuple[str, ...]
    source: str
    match: Callable[[Context, ir.Node], Any]
    check: Callable[[Context, Any], str | None]
    rewrite: Callable[[Context, Any], None]


def apply(ctx: Context, rule: Rule) -> dict:
    """Run one rule over the graph once; returns ``{"applied": n, "not_matched": {reason: count}}``."""
    applied = 0
    skipped: dict[str, int] = {}
    gr = ctx.graph
    # A snapshot of the nodes: each is visited once, unless an earlier rewrite removed it (the nodes a
    # rewrite makes are not in the snapshot).
    for node in list(gr.g):
        if node.graph is not gr.g or node.op_type not in rule.anchors:
            continue
        m = rule.match(ctx, node)
        if isinstance(m, NoMatch):
            skipped[m.reason] = skipped.get(m.reason, 0) + 1
            logger.debug("%s: %s did not match %s: %s", ctx.name, rule.name, node.name, m.reason)
            continue
        reason = rule.check(ctx, m)
        if reason is not None:
            ctx.problems.append(f"{node.name} ({node.op_type}): {reason}")
            continue
        rule.rewrite(ctx, m)
        applied += 1
    gr.dce()
    return {"applied": applied, "not_matched": skipped}
