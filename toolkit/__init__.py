"""Declarative build recipes and strict libcst patches for vendor vLLM images."""

__version__ = "0.1.0"
