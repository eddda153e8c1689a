"""Data: synthetic corpus, tokenizers, text → MDS conversion and the streaming text loader.

Submodules import their heavy dependencies (transformers, streaming, torch) lazily; import
them directly, e.g. ``from foundryx.data.convert import convert_to_mds``.
"""
