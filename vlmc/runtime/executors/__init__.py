"""Executors: what runs one graph for the runtime's generation loop (a package's, or a compile output's build)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
