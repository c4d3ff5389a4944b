"""Unit tests of vlmc/exporters/, one file per module."""
