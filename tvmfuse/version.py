"""tvmfuse's version (floor: logs and artifacts record it without importing the package's upper layers)."""
__version__ = "0.1.0"
