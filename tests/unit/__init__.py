"""Unit tests beside each pass and rule, on small hand-built onnx-ir graphs.

A package, so its test files may share basenames with the integration tests in tests/.
"""
