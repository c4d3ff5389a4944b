"""Unit tests of passes/quantize/, one file per module."""
