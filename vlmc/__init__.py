"""vlmc: compile Hugging Face vision-language models into checked ONNX packages and Ascend builds."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
