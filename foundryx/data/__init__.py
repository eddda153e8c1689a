"""Data: text → MDS conversion, the streaming ``text`` loader, the ``finetuning`` loader.

Modules: ``sources`` (input readers), ``convert`` (+ ``parallel``, ``partial``,
``chunk_writer``: workers, resumable work folders, shards), ``text`` (+ ``streams`` for
mixing, ``shm`` for shared memory), ``finetuning`` (examples, masking, loader), ``packing``,
``options`` (loader config checks), ``tokenizers``, ``synthetic`` and ``quickstart``. Submodules import their heavy dependencies
(transformers, streaming, torch, datasets) lazily; import them directly, e.g.
``from foundryx.data.convert import convert_to_mds``. See docs/data.md.
"""
