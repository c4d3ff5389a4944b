"""Runtime: runs a vlmc package (or a compile output) driven only by its manifest: the loop and its executors."""

from __future__ import annotations

from vlmc.runtime.executors.ort import Executor, OrtExecutor
from vlmc.runtime.opener import Target, open, prepare, target
from vlmc.runtime.pipeline import GenerationResult, Pipeline

__all__ = ["Executor", "GenerationResult", "OrtExecutor", "Pipeline", "Target", "open", "prepare", "target"]
