"""Unit tests of vlmc/backends/, one file per module."""
