"""FlashAttention-2 in Triton: kernels.py, backward_kernels.py, backward_dq_kernels.py (@triton.jit only), tiles.py (tile
configurations: the table, pinning, autotuning, the cache) -> launch.py (validate, pick, allocate,
launch) -> function.py (the autograd.Function and its operators).

Without a CUDA device the kernels run under the Triton interpreter: `cs336_systems/__init__.py` sets
TRITON_INTERPRET=1 when the package is imported, before Triton can be ([Note: Triton interpreter]).
The Hopper kernels (hopper*.py, Gluon) do not run there; studies/attention/flash_offline.py compiles them for sm_90a on any
host and reads their registers, spills and shared memory.
"""

from cs336_systems.attention.flash_triton.function import FlashAttentionTriton, flash_attention_triton
from cs336_systems.attention.flash_triton.launch import flash_bwd, flash_fwd
from cs336_systems.attention.flash_triton.tiles import (
    BwdConfig,
    FwdConfig,
    KernelOptions,
    set_autotune,
    use_configs,
)

__all__ = [
    "BwdConfig",
    "FlashAttentionTriton",
    "FwdConfig",
    "KernelOptions",
    "flash_attention_triton",
    "flash_bwd",
    "flash_fwd",
    "set_autotune",
    "use_configs",
]
