"""Measurement harness: timers, FLOP formulas, tidy results with provenance, and benchmark CLIs."""
