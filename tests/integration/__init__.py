"""Topic tests: whole builds, families, the CLI, untrusted inputs, serving, the matrix.

A package, so its test files may share basenames with the unit tests in tests/unit/.
"""
