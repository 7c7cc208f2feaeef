"""Shared test setup.

* Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before any
  module defining @triton.jit kernels is imported, hence here.
* `gpu` / `multigpu` tests are skipped only where the hardware is missing; on the GPU host they run
  (`make test-gpu`).
* Every test starts from the same seed.
* Tests may read the committed figures/data/ but never write it: the session fails if it changed
  (a test that measures passes a tmp results directory; quick runs default to a scratch one).
* On a GPU host, deterministic-algorithm tests need a cuBLAS workspace setting before CUDA starts.
* Every `distributed` test (several processes) carries its own timeout marker, or collection fails.
* Jupyter and IPython keep their per-user state in a temporary directory: notebook kernels started by
  the tests must not write into ~/.jupyter or ~/.ipython (jupyter_core's one-off IPython migration
  drops a `migrated` marker there, which the Lab tests rightly report as a change to the user's home).
"""

import atexit
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch

_JUPYTER_HOME = Path(tempfile.mkdtemp(prefix="cs336-tests-jupyter-"))
for _var, _sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"), ("IPYTHONDIR", "ipython")):
    os.environ.setdefault(_var, str(_JUPYTER_HOME / _sub))
atexit.register(shutil.rmtree, _JUPYTER_HOME, ignore_errors=True)

COMMITTED_RESULTS = Path(__file__).resolve().parents[1] / "figures" / "data"

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


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(autouse=True, scope="session")
def _committed_results_untouched():
    """No test, quick run or CLI smoke run may change the committed results (fails the session)."""
    before = _digest(COMMITTED_RESULTS)
    yield
    after = _digest(COMMITTED_RESULTS)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the test session modified committed results in figures/data/: {changed}"


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
