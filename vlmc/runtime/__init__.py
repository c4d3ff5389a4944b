"""Reference runtime: runs any vlmc package on onnxruntime CPU, driven only by its manifest."""

from __future__ import annotations

from vlmc.runtime.executors.ort import Executor, OrtExecutor
from vlmc.runtime.pipeline import GenerationResult, Pipeline

__all__ = ["Executor", "GenerationResult", "OrtExecutor", "Pipeline"]
