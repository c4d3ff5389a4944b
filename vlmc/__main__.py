"""Entry point for ``python -m vlmc``."""

from __future__ import annotations

from vlmc.cli import main

if __name__ == "__main__":
    main()
