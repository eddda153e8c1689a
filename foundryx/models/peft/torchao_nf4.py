"""torchao's NF4 tensor and the helpers foundryx builds it with, wherever the installed torchao
keeps them: ``torchao.dtypes.nf4tensor`` up to 0.17, ``torchao.quantization`` (the module
``NF4Tensor`` is defined in) from 0.18. Import it inside the function that needs it: torchao is
a heavy import.
"""

from __future__ import annotations

import importlib

try:  # torchao < 0.18
    _nf4 = importlib.import_module("torchao.dtypes.nf4tensor")
except ImportError:  # torchao >= 0.18: public name in torchao.quantization, helpers beside it
    import torchao.quantization

    _nf4 = importlib.import_module(torchao.quantization.NF4Tensor.__module__)

NF4Tensor = _nf4.NF4Tensor
to_nf4 = _nf4.to_nf4
SubclassTensorArgs = _nf4.SubclassTensorArgs
construct_nf4_args = _nf4.construct_nf4_args
get_block_absmax = _nf4.get_block_absmax

__all__ = ["NF4Tensor", "SubclassTensorArgs", "construct_nf4_args", "get_block_absmax", "to_nf4"]
