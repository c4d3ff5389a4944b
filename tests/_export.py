"""Models built in code in a test, exported as a built-in of their family."""

from __future__ import annotations

from pathlib import Path


def export_model(tmp_path_factory, model, name: str, family: str) -> Path:
    """A model built in code (random weights, eager attention) exported as the built-in ``name`` of ``family``."""
    from vlmc import exporters

    exporters._eager(model)
    source = exporters.Source(name=name, model=model, config=model.config, family=family, builtin=True)
    out = tmp_path_factory.mktemp(name.replace(".", "_")) / "pkg"
    exporters.export(source).save(out)
    return out
