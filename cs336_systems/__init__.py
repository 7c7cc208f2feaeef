"""cs336_systems: CS336 Assignment 2 (Systems), implemented from scratch.

Subpackages are imported lazily by their users so that, for example, the distributed code does not
pull in Triton and the attention kernels do not pull in torch.distributed.
"""

__version__ = "0.1.0"
