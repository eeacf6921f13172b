"""The engine's version (prepacked snapshots record it)."""

__version__ = "0.1.0"
