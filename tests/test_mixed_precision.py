"""benchmarking_mixed_precision helpers: dtypes observed under autocast, LayerNorm precision, configs."""

import pytest
import torch

from cs336_systems.model import SIZES_2025
from cs336_systems.studies.profiling import mixed_precision as A


def test_toy_model_dtypes_under_cpu_bf16_autocast():
    table = A.dtype_table("cpu")
    assert table.attrs == {"device": "cpu", "autocast_dtype": "torch.bfloat16"}
    got = dict(zip(table.quantity, table.dtype))
    assert got["model parameters (inside autocast)"] == "torch.float32"  # autocast never changes storage
    assert got["fc1 matmul operands (autocast's cast copies)"] == "torch.bfloat16"
    assert got["fc1 output"] == "torch.bfloat16"
    assert got["logits (fc2 output)"] == "torch.bfloat16"
    assert got["loss"] == "torch.float32"
    assert got["parameter gradients"] == "torch.float32"
    # LayerNorm follows the device's autocast policy: recompute it independently of the hooks.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.nn.LayerNorm(10)(torch.randn(4, 10, dtype=torch.bfloat16)).dtype
    assert got["LayerNorm output"] == str(expected)


def test_dtype_table_honours_the_requested_dtype():
    got = dict(A.dtype_table("cpu", torch.float16).itertuples(index=False))
    assert got["fc1 output"] == "torch.float16" and got["parameter gradients"] == "torch.float32"


def test_dtype_rows():
    rows = A.dtype_rows(A.dtype_table("cpu"))
    assert len(rows) == 8
    assert {r["problem"] for r in rows} == {"benchmarking_mixed_precision"}
    bits = {r["mode"]: r["mean"] for r in rows}
    assert bits["loss"] == 32 and bits["fc1 output"] == 16
    assert [r["x_value"] for r in rows] == list(range(8)) and rows[0]["impl"] == "bf16-autocast"


def test_layernorm_precision():
    wide = A.layernorm_precision(spread=300.0).set_index("dtype")
    assert wide.loc["float16", "squares overflowed"] and not wide.loc["bfloat16", "squares overflowed"]
    assert wide.loc["float16", "variance rel. error"] == float("inf")
    assert wide.loc["float32", "output max abs error"] < 1e-5
    assert 1e-3 < wide.loc["bfloat16", "output max abs error"] < 0.2  # ~3 significant digits, no overflow
    narrow = A.layernorm_precision(spread=1.0).set_index("dtype")
    assert not narrow["squares overflowed"].any()
    assert narrow.loc["float16", "output max abs error"] < narrow.loc["bfloat16", "output max abs error"]


def test_timing_configs():
    cfgs = A.timing_configs(device="cpu")
    assert len(cfgs) == len(SIZES_2025) * 2 * 2
    assert {c.dtype_label for c in cfgs} == {"fp32", "bf16-autocast"}
    assert {c.mode for c in cfgs} == {"forward", "train"}
    assert {(c.context_length, c.warmup, c.steps) for c in cfgs} == {(512, 5, 10)}


def test_autocast_default_dtype():
    assert A.default_autocast_dtype("cuda") == torch.float16
    assert A.default_autocast_dtype("cpu") == torch.bfloat16


@pytest.mark.gpu
def test_toy_model_dtypes_under_cuda_fp16_autocast():
    got = dict(A.dtype_table("cuda").itertuples(index=False))
    assert got["fc1 output"] == "torch.float16" and got["LayerNorm output"] == "torch.float32"
    assert got["logits (fc2 output)"] == "torch.float16" and got["loss"] == "torch.float32"
