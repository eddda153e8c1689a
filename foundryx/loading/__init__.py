"""Pretrained weights read shard by shard: each rank reads only its own rows of each tensor of
a Hugging Face safetensors folder into its (already sharded, possibly low-precision)
parameters. Above ``models`` and ``parallel`` (it uses both; neither uses it); called by
:mod:`foundryx.builders` around parallelism (docs/design.md)."""

from foundryx.loading.dtypes import keep_stored_dtype
from foundryx.loading.files import PretrainedLoadError
from foundryx.loading.load import LoadPlan, load, prepare, wants_pretrained

__all__ = ["LoadPlan", "PretrainedLoadError", "keep_stored_dtype", "load", "prepare",
           "wants_pretrained"]
