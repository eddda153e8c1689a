"""Triton kernels. Import the submodules directly (they import Triton):

- :mod:`foundryx.kernels.flash_attention`: FlashAttention-2 forward + backward
  (``flash_attention``), used by ``attn_impl: triton``;
- :mod:`foundryx.kernels.tuning`: tile sizes per device family.
"""
