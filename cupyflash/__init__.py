"""cupyflash: exact FlashAttention (forward and backward) for CuPy arrays.

CuPy arrays run CUDA kernels compiled at run time with NVRTC; NumPy arrays run a
tiled CPU path with the same semantics.  See :func:`flash_attn_fwd` for the
conventions (layout, causal alignment, lse, GQA) and the attention variants
(window, softcap, ALiBi, sinks, dropout; :func:`manual_seed` seeds the dropout
state a forward draws when given none).  :func:`flash_attn_with_kvcache`
decodes against a dense or paged KV cache.

Importing this package does not import CuPy.
"""

from . import reference, testing
from ._api import flash_attn, flash_attn_bwd, flash_attn_fwd
from ._blockmask import BlockMask
from ._kvcache import flash_attn_with_kvcache
from ._launch import release_graph_scratch
from ._rng import manual_seed
from ._varlen import flash_attn_varlen, flash_attn_varlen_bwd, flash_attn_varlen_fwd

__version__ = "0.1.0"

__all__ = ["BlockMask", "flash_attn_fwd", "flash_attn_bwd", "flash_attn", "flash_attn_varlen_fwd",
           "flash_attn_varlen_bwd", "flash_attn_varlen", "flash_attn_with_kvcache", "manual_seed",
           "release_graph_scratch", "reference", "testing", "__version__"]
