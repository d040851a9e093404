"""The package version (a leaf module: importable from anywhere without cycles)."""

__version__ = "0.1.0"
