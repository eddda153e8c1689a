"""A Llama decoder in plain PyTorch, without transformers: the architecture of transformers'
``LlamaForCausalLM`` (and ``MistralForCausalLM`` without a sliding window) for the standalone
eval's scoring and greedy generation, loaded from a Hugging Face folder (docs/eval.md, "The
native Llama").

- ``spec``: :class:`LlamaSpec` from a ``config.json`` dict, and :func:`unsupported` (why a
  config is one this model does not reproduce exactly);
- ``model``: :class:`LlamaLM` and its :class:`KVCache`;
- ``load``: :func:`load_hf_llama`, a folder's safetensors weights into a :class:`LlamaLM`, and
  :func:`native_problem` (why a folder would not load: decide before loading).
"""

from foundryx.models.llama.load import load_hf_llama, native_problem
from foundryx.models.llama.model import KVCache, LlamaLM
from foundryx.models.llama.spec import LlamaSpec, spec_from_hf_config, unsupported

__all__ = ["KVCache", "LlamaLM", "LlamaSpec", "load_hf_llama", "native_problem",
           "spec_from_hf_config", "unsupported"]
