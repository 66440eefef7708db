"""torchtpu's version, in its own module: lower layers read it without importing the package root."""
__version__ = "0.1.0"
