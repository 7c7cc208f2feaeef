"""Measurement harness shared by every study: timers (`timing`), FLOP formulas and MFU (`flops`), the
tidy results store with provenance (`results`), NVTX/record_function annotations (`annotations`) and the
wall-clock budget of a GPU run (`budget`).

Layer: imports the library (model, attention, distributed, accounting) only, never a study or report.
"""
