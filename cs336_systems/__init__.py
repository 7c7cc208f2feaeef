"""cs336_systems: CS336 Assignment 2 (Systems), implemented from scratch.

Subpackages are imported lazily by their users so that, for example, the distributed code does not
pull in Triton and the attention kernels do not pull in torch.distributed.

[Note: Triton interpreter] Without a CUDA device the Triton kernels run under the interpreter, which
Triton reads when `triton.language` is first imported, and PyTorch may import Triton on its own
(e.g. the first CPU backward of SDPA). So TRITON_INTERPRET=1 is set here, when the package is
imported, unless the environment already says otherwise or Triton is already loaded.
"""

import os
import sys

__version__ = "0.1.0"


def _default_triton_interpreter() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton.language" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_default_triton_interpreter()
