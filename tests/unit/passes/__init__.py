"""Unit tests of passes/, one file per module."""
