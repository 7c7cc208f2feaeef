"""Shared test setup.

* Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before any
  module defining @triton.jit kernels is imported, hence here.
* `gpu` / `multigpu` tests are skipped only where the hardware is missing; on the GPU host they run
  (`make test-gpu`).
* Every test starts from the same seed.
* On a GPU host, deterministic-algorithm tests need a cuBLAS workspace setting before CUDA starts.
* Every `distributed` test (several processes) carries its own timeout marker, or collection fails.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    untimed = [
        i.nodeid for i in items if "distributed" in i.keywords and i.get_closest_marker("timeout") is None
    ]
    if untimed:  # a hung collective must fail its test, not stall CI until the global limit
        raise pytest.UsageError(f"distributed tests without a @pytest.mark.timeout: {untimed}")
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ CUDA GPUs"))


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_worker():
    # Two xdist workers on two cores: OpenMP spin-waiting otherwise makes small CPU ops 50x slower.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
