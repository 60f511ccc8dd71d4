"""The package version (the command line and ``cr.__version__`` read it)."""

__version__ = "0.1.0"
