"""Studies of the distributed problems, run as `torchrun` workers from a driver in the same module:
`comm_bench` (all-reduce), `train_bench` (DDP variants), `sharding_bench` (optimizer state sharding),
`fsdp_bench` (FSDP), `ddp_check` (DDP against one process), with their figures in `plots` and
`trace_plot`. Grouped apart from the single-GPU studies because they share the torchrun launch path
(`cs336_systems.distributed.launch`) and their figures.
"""
