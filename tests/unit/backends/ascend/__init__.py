"""Unit tests of vlmc/backends/ascend/, one file per module."""
