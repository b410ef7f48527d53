"""The version, in a leaf module every stage may import."""

__version__ = "0.1.0"
