"""Unit tests of vlmc/runtime/, one file per module."""
