"""A stand-in for LLM Foundry 0.22 (tests/peer_stubs/README.md)."""

__version__ = "0.22.0-stand-in"
