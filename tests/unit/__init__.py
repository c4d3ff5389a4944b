"""Unit tests, one file per module, in folders that mirror vlmc/ and passes/ (small hand-built graphs).

A package, so its test files may share basenames with the topic tests in tests/integration/.
"""
