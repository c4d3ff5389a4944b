"""The Ascend lowering's rewrite rules, one private module per pattern, in the order they run."""

from __future__ import annotations

import logging

from ._base import Context, NoMatch, Rule, apply
from ._graph import Graph
from ._leftover_qdq import leftover_qdq_rule
from ._qdq_conv import qdq_conv_rule
from ._qdq_matmul import qdq_matmul_rule
from ._weight_only_matmul import INT4_NOTE, legal_group_size, weight_only_matmul_rule

logger = logging.getLogger(__name__)

__all__ = [
    "INT4_NOTE",
    "Context",
    "Graph",
    "NoMatch",
    "Rule",
    "apply",
    "default_rules",
    "legal_group_size",
]


def default_rules() -> list[Rule]:
    """The rules in order: int8 cores first (they consume the Q/DQ around them), then weight-only
    MatMuls, then whatever Q/DQ is left."""
    return [qdq_matmul_rule(), qdq_conv_rule(), weight_only_matmul_rule(), leftover_qdq_rule()]
