# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # naive_ddp (2025 §2.2)
# A naive DDP script: broadcast rank 0's parameters, shard each batch over the ranks, run forward and
# backward locally, all-reduce (average) every gradient individually, step. Verify on a toy model that
# the weights match single-process training.

# %% tags=["parameters"]
measure = "auto"  # the check runs on CPU with Gloo: it is computed live in every mode
quick = False  # the check is already small; quick changes nothing but the scratch directory
world_size = 2
steps = 5
variants = ["naive", "flat", "overlap", "bucketed:0.003"]  # naive first; the others use the same check

# %% tags=["remove-input"]
import inspect

from cs336_systems.distributed import NaiveDDP
from cs336_systems.report import nb, show_table
from cs336_systems.studies.distributed import ddp_check

results_dir = nb.setup(quick)
checks = ddp_check.check_against_single_process(variants, world_size=world_size, steps=steps)

# %% tags=["remove-input"]
facts = ddp_check.facts(checks)
nb.md(
    f"**Answer.** `cs336_systems.distributed.NaiveDDP` broadcasts every parameter and buffer from rank 0 in its "
    "constructor and, in `finish_gradient_synchronization()` (between `backward()` and `optimizer.step()`), "
    "SUM-all-reduces each trainable gradient and divides it by the world size (Gloo has no AVG). Before wrapping, "
    "every rank had its own random initialisation; the broadcast "
    f"left rank 0 untouched ({facts['rank0_changed']} parameters changed) and replaced "
    f"{facts['replaced']} on the other rank(s) (every parameter except a fixed one, already equal). "
    f"After each of the {steps} steps, the naive DDP parameters are identical on all "
    f"ranks (largest difference {facts['max_across_ranks']:.1g}) and differ from single-process "
    f"training by at most {facts['max_vs_single']:.2g}, i.e. float32 rounding from summing the "
    f"gradient in a different order (two half-batch means averaged instead of one full-batch mean). The same "
    f"check passes for the flat, overlapping and bucketed variants (largest difference "
    f"{facts['worst_vs_single']:.2g}), and "
    f"`tests/test_ddp.py` repeats it with the official toy models, the official test flow, gradient accumulation "
    f"(`no_sync`), parameters without gradients and 3 ranks."
)

# %% tags=["remove-input", "remove-cell"]
src = inspect.getsource(NaiveDDP.finish_gradient_synchronization)
nb.md(f"The gradient synchronization of `NaiveDDP`:\n\n```python\n{src}```")

# %% tags=["remove-input"]
show_table(
    ddp_check.variants_table(checks),
    caption=f"Every DDP variant on {facts['world_size']} Gloo ranks against single-process training, {steps} SGD steps: "
    "largest parameter difference",
    provenance_from="computed live on CPU (Gloo) when this notebook ran",
)


# %% [markdown] tags=["appendix"]
# **Check.** `cs336_systems.studies.distributed.ddp_check` runs under `torchrun` with Gloo on CPU: each rank
# seeds its toy model (10 -> 10 -> 50 -> 10 -> 50 -> 5 with ReLUs, a tied weight, a frozen bias and a fixed
# parameter) differently, wraps it and trains with SGD (lr 0.1, MSE) on its shard of 16 random examples; one
# process trains a copy of rank 0's initial model on all 16.
