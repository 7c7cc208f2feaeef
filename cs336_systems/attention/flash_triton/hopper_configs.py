"""Configurations of the Hopper (sm_90) Gluon kernels (`hopper.py` launches them): the forwards'
(`HopperFwdConfig`, `WarpSpecializedFwdConfig`) and backwards' (`HopperBwdConfig`,
`WarpSpecializedBwdConfig`) tiles, register budgets and options, the defaults per head dim
(`heuristic_fwd`, `heuristic_bwd`, `ONE_PASS_CONFIGS`), the column split of head dims that are not
a power of two, the grid's head groups ([Note: tile order]) and a configuration with some fields
replaced from a "FIELD=VALUE[+...]" text (`with_fields`, `changed_backward`). Pure Python: no GPU, no
Triton.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HopperFwdConfig:
    block_m: int = 128
    block_n: int = 128
    stages: int = 3
    num_warps: int = 8
    head_major: bool = True  # one-dimensional grid, heads in groups of group_heads (program_tile)
    group_heads: int = 1  # head_major: heads a group (a divisor of B * H); 0: [Note: tile order]'s rule

    def __post_init__(self) -> None:
        check_group_heads(self)


PRODUCER_REGS = 24  # the producer warp's registers a thread (the least setmaxnreg allows)
HEAD_MAJOR_MIN_TILES = 8  # query tiles a head needs before a forward's grid goes head-major


REGISTER_FILE = 65_536  # 32-bit registers of one SM, all of them for the one program it runs


def check_register_budget(cfg, consumers: int, consumer_regs: int, dq_regs: int = 0) -> None:
    """Raise a ValueError naming `cfg` unless its setmaxnreg budgets are multiples of 8 in 24..256 and
    its launch fits one SM's register file: every warpgroup (the consumers, the producer's, a dQ
    warpgroup; setmaxnreg moves registers a warpgroup at a time) at `warp_specialized_maxnreg`."""
    budgets = [consumer_regs] + ([dq_regs] if dq_regs else [])
    if any(r % 8 or not 24 <= r <= 256 for r in budgets):
        raise ValueError(f"{cfg}: register budgets must be multiples of 8 in 24..256, got {budgets}")
    warpgroups = consumers + 1 + (dq_regs > 0)
    need = warpgroups * 128 * warp_specialized_maxnreg(consumers, consumer_regs, dq_regs)
    if need > REGISTER_FILE:
        raise ValueError(
            f"{cfg}: its {warpgroups} warpgroups need {need} registers, an SM has {REGISTER_FILE}"
        )


def warp_specialized_maxnreg(consumers: int, consumer_regs: int, dq_regs: int = 0) -> int:
    """Registers a thread at launch of a warp-specialised kernel: the consumers' share plus the
    producer's (and a one-pass backward's dQ warpgroup's), spread over the program's warpgroups,
    rounded up to 8 (one program per SM at 2 x 240 or 3 x 160). setmaxnreg then moves registers
    between the partitions."""
    need = consumers * consumer_regs + PRODUCER_REGS + dq_regs
    return math.ceil(need / (consumers + 1 + (dq_regs > 0)) / 8) * 8


@dataclass(frozen=True)
class WarpSpecializedFwdConfig:
    """The warp-specialised forward (`hopper_ws_kernels.py`): `consumers` warpgroups of 64 query rows
    share each K/V tile of `block_n` keys, a producer warp fills a `stages`-deep ring; with
    `pingpong` the consumers take turns issuing their products."""

    consumers: int = 2
    block_n: int = 128
    stages: int = 2
    pingpong: bool = False  # slower on an H100 in every configuration measured (session 10)
    consumer_regs: int = 240
    head_major: bool = True  # one-dimensional grid, heads in groups of group_heads (program_tile)
    group_heads: int = 1  # head_major: heads a group (a divisor of B * H); 0: [Note: tile order]'s rule
    # the wait for P V kept after the softmax ([Note: the wait for P V after the softmax], hopper_ws_kernels)
    late_pv_wait: bool = True

    def __post_init__(self) -> None:
        check_register_budget(self, self.consumers, self.consumer_regs)
        check_group_heads(self)

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def maxnreg(self) -> int:
        return warp_specialized_maxnreg(self.consumers, self.consumer_regs)


def split_head_dim(d: int) -> int | None:
    """D0 of the kernels' column split (d itself for a power of two), or None if d cannot be split."""
    if d < 16 or d > 256:
        return None
    d0 = 1 << (d.bit_length() - 1)
    if d0 == d:
        return d
    d1 = d - d0
    return d0 if d1 >= 16 and d1 & (d1 - 1) == 0 else None


# Head dims whose backward defaults to the one-pass kernel, where it was measured faster than the two
# passes (OPTIMIZATION_LOG.md, "Session 11" and "Session 12"): dQ added by a third warpgroup at d = 64
# and 80, by the two consumers at d = 128 (a third warpgroup does not fit there).
ONE_PASS_HEAD_DIMS: frozenset[int] = frozenset({64, 80, 128})


def heuristic_fwd(d: int) -> HopperFwdConfig | WarpSpecializedFwdConfig:
    """Forward tiles by head dim (the fastest of the H100 sweeps in OPTIMIZATION_LOG.md, "Sessions 7-8"
    and "Session 10", "Session 12"; d = 80's from the A/Bs of "Session 19" and "Session 20", on an H200
    and an H100): the warp-specialised kernel at d = 128 (two consumer warpgroups, 128-key tiles, three
    stages, no ping-pong, the wait for P V after the softmax) and d = 80 (three consumer warpgroups,
    64-key tiles, three stages, the wait where ptxas puts it), the one-warpgroup kernel elsewhere."""
    # d = 80, 128 x 2048 x 80 causal (H200): one warpgroup 0.468 ms, two consumers 0.371-0.372, three 0.322.
    # The late wait for P V costs the three 64-key consumers 1.8 % there (0.332 against 0.326 ms, H100),
    # while it saves 3.6 % at d = 128 (14.27 against 14.80 ms at 32 x 32768): OPTIMIZATION_LOG, session 21.
    if d == 80:
        return WarpSpecializedFwdConfig(
            consumers=3, consumer_regs=152, block_n=64, stages=3, late_pv_wait=False
        )
    if split_head_dim(d) != d:  # two column blocks (d = 96, ...)
        return HopperFwdConfig(128, 64, 3, 8)
    if d <= 64:
        return HopperFwdConfig(128, 64, 4, 8)
    if d == 128:  # three K/V stages (229.7 KB of shared memory): 16.1 -> 14.1 ms at 32 x 32768 (H100)
        return WarpSpecializedFwdConfig(consumers=2, block_n=128, stages=3, late_pv_wait=True)
    return HopperFwdConfig(64, 64, 3, 4)


# [Note: tile order]
# Causal programs differ in length: a forward's query tile t reads t + 1 key tiles, a backward's key
# tile t runs over every query step from t on. The GPU takes programs in grid order as SMs free up,
# so the longest should come first and the last wave hold short ones. A grid with one head after the
# other (kept for L2: the programs resident at a time share that head's operands) does this only when
# a head has many more tiles than the GPU has SMs: at 16 x 16384 (128 key tiles of 128 a head, 132
# SMs on an H100) the last head's longest programs start when the others are nearly done. So heads
# go in groups, the fewest that fill the SMs, and a group's tiles go tile by tile across its heads:
# in a model of the schedule (programs as long as their steps, taken in grid order; test_attention_
# hopper.py) the SMs are busy 99.9 % of a causal backward's time at 16 x 16384 and 16 x 8192 (d = 128),
# against 93.1 % and 86.6 % with one head after the other in the backward's order before session 18
# (shortest key tiles first; ncu: 93 % of SM cycles active at 16 x 16384 on an H100), and 99.8 % and
# 90.0 % one head after the other, longest first. Measured (the backward, H100, interleaved A/B
# against the old order): -6.8 % at 32 x 32768 x 128, -6.1 % at 16 x 16384 x 128 (OPTIMIZATION_LOG,
# session 18). The forwards were already longest first; their grouping (`group_heads=0`) is not yet
# measured, so they keep one head after the other (`group_heads=1`) by default.


def check_group_heads(cfg) -> None:
    """Raise a ValueError naming `cfg` unless its group_heads is an integer >= 0."""
    g = cfg.group_heads
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        raise ValueError(f"{cfg}: group_heads must be an integer >= 0 (0: the rule), got {g!r}")


def check_group(cfg, heads_total: int) -> None:
    """Raise a ValueError naming `cfg` when its group_heads (if any, and not the rule's 0) does not
    divide `heads_total` (B * H): before any work on a problem."""
    g = getattr(cfg, "group_heads", 0)
    if g and heads_total % g:
        raise ValueError(f"{cfg}: group_heads must divide batch x heads = {heads_total}")


def group_heads(heads_total: int, n_tiles: int, sms: int) -> int:
    """Heads per group of a head-major grid ([Note: tile order]): the smallest divisor of
    `heads_total` (B * H) whose group has at least `sms` programs of `n_tiles` a head."""
    return next(
        g
        for g in range(1, heads_total + 1)
        if heads_total % g == 0 and (g * n_tiles >= sms or g == heads_total)
    )


@dataclass(frozen=True)
class HopperBwdConfig:
    """dK/dV pass: block_n keys per program, block_m queries per step, a stages-deep Q/dO ring."""

    block_m: int = 64
    block_n: int = 64
    stages: int = 2
    num_warps: int = 4
    maxnreg: int | None = None


def heuristic_bwd(d: int) -> HopperBwdConfig | WarpSpecializedBwdConfig:
    """Backward kernel and tiles by head dim: at the head dims of `ONE_PASS_HEAD_DIMS` (64, 80, 128)
    the one-pass kernel (`ONE_PASS_CONFIGS`); elsewhere the one-warpgroup dK/dV pass with
    64 keys x 64-query steps, two stages, the fastest one-warpgroup candidate on an H100 at d = 64
    and 80 (flash_bench --tune-hopper; at d = 80 3.50 ms against 4.06 for 32-query steps, which need
    fewer registers, 190 instead of 254, but issue twice the waits). Above d = 128 the two fp32
    accumulators (dK, dV: 64 key rows x d per warpgroup) spill whatever the step, so the step
    shrinks to 16 queries to keep the score tiles small."""
    if d in ONE_PASS_HEAD_DIMS:
        return ONE_PASS_CONFIGS[d]
    if d <= 128:
        return HopperBwdConfig(64, 64, 2, 4)
    return HopperBwdConfig(16, 64, 2, 4)


@dataclass(frozen=True)
class WarpSpecializedBwdConfig:
    """The warp-specialised backward (`hopper_ws_backward_kernels.py`): `consumers` (2 or 3)
    warpgroups of 64 keys share each Q/dO tile of `block_m` queries, a producer warp fills a
    `stages`-deep ring; three consumers fit the register file at 160 a thread with 32-query steps.
    `dq_regs` > 0 makes it one pass: a dQ warpgroup with that many registers a thread adds dS K into
    a float32 dQ (two consumers, 64-query steps), instead of the tl dQ pass; the consumers hand it
    their dS^T tiles through a `ds_slots`-deep shared-memory ring. `dq_in_consumers` makes it one
    pass without that warpgroup: each consumer computes one column half of dQ from both dS^T tiles
    (head dims of two equal power-of-two halves: 32, 64, 128, 256), keeping registers for 128-wide
    dK/dV accumulators. `group_heads` and `shortest_first`: the grid's order ([Note: tile order])."""

    block_m: int = 64
    stages: int = 2
    consumer_regs: int = 240
    consumers: int = 2
    dq_regs: int = 0
    ds_slots: int = 2  # one pass: depth of the consumers' dS^T ring that the dQ warpgroup reads
    dq_buffers: int = 2  # one pass: float32 dQ staging tiles in flight to the TMA reductions
    dq_in_consumers: bool = False  # one pass, dQ computed by the two consumers (no dQ warpgroup)
    group_heads: int = 0  # heads a group of the grid (a divisor of B * H); 0: [Note: tile order]'s rule
    shortest_first: bool = False  # the order before session 18 (causal: last key tile first), to A/B
    # one pass: dQ's float32 staging rows interleaved, free of bank conflicts, where N_QUERIES is a
    # multiple of 64 (hopper_ws_dq_kernels' [Note: dQ's staging rows interleaved]); off until measured
    dq_rows_interleaved: bool = False

    def __post_init__(self) -> None:
        if (self.dq_regs or self.dq_in_consumers) and (self.consumers != 2 or self.block_m != 64):
            raise ValueError(f"{self}: the one-pass backward takes two consumers and 64-query steps")
        if self.dq_rows_interleaved and not (self.dq_regs or self.dq_in_consumers):
            raise ValueError(f"{self}: dq_rows_interleaved is an option of the one-pass backward")
        if self.dq_regs and self.dq_in_consumers:
            raise ValueError(f"{self}: dQ either in a warpgroup of its own (dq_regs) or in the consumers")
        check_register_budget(self, self.consumers, self.consumer_regs, self.dq_regs)
        check_group_heads(self)

    @property
    def one_pass(self) -> bool:
        return self.dq_regs > 0 or self.dq_in_consumers

    def head_split(self, d: int) -> int | None:
        """D0 of the kernel's column split for head dim d (None: this configuration cannot take d)."""
        if not self.dq_in_consumers:
            return split_head_dim(d)
        half = d // 2
        return half if d % 2 == 0 and split_head_dim(half) == half else None

    @property
    def block_n(self) -> int:
        return 64 * self.consumers

    @property
    def maxnreg(self) -> int:
        return warp_specialized_maxnreg(self.consumers, self.consumer_regs, self.dq_regs)


def parse_fields(cls, spec: str) -> dict[str, Any]:
    """The fields of `spec`, "FIELD=VALUE[+FIELD=VALUE...]" with Python literals, checked against the
    dataclass `cls`'s field names; a ValueError names a bad field or value."""
    fields = {f.name for f in dataclasses.fields(cls)}
    changes: dict[str, Any] = {}
    for part in spec.split("+"):
        name, sep, value = part.partition("=")
        if not sep or name not in fields:
            raise ValueError(
                f"{part!r} is not FIELD=VALUE with FIELD of {cls.__name__}: {', '.join(sorted(fields))}"
            )
        try:
            changes[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{part!r}: {value!r} is not a Python literal") from None
    return changes


def with_fields(cfg, spec: str):
    """`cfg` (a dataclass configuration) with `spec`'s fields (`parse_fields`) replaced; the
    configuration's own checks run. What `KernelOptions.hopper_bwd` and `flash_bench --ab-variants` say."""
    return dataclasses.replace(cfg, **parse_fields(type(cfg), spec))


def changed_backward(d: int, spec: str) -> WarpSpecializedBwdConfig:
    """The warp-specialised backward of head dim d (`heuristic_bwd`) with `spec`'s fields replaced
    (`with_fields`); a ValueError where d's backward is not warp-specialised."""
    base = heuristic_bwd(d)
    if not isinstance(base, WarpSpecializedBwdConfig):
        raise ValueError(f"{spec!r} changes the warp-specialised backward; head dim {d} uses {base}")
    return with_fields(base, spec)


# The two-pass warp-specialised backward (dK/dV here, dQ by the tl pass): the d = 128 default before
# session 12's one-pass kernel; its dK/dV pass took 0.95x / 0.64x / 0.78x the tl pass's time at d = 64 /
# 80 / 128 on an H100 (OPTIMIZATION_LOG.md, session 11). What `deterministic_backward` runs there.
TWO_PASS_BWD = WarpSpecializedBwdConfig()


def deterministic_backward(d: int, spec: str = "") -> HopperBwdConfig | WarpSpecializedBwdConfig:
    """The Hopper backward of head dim d whose results repeat bit for bit (`KernelOptions.deterministic`):
    dQ by a pass of its own (the tl dQ kernel, no atomics), never by a one-pass kernel's float32
    reductions, whose order varies. Where d's default is one pass (`ONE_PASS_HEAD_DIMS`), the two-pass
    warp-specialised kernel `TWO_PASS_BWD` with spec's fields replaced (a ValueError where they ask for
    one pass); elsewhere d's default, which is two passes already (spec: as `changed_backward`)."""
    base = heuristic_bwd(d)
    if not isinstance(base, WarpSpecializedBwdConfig):
        return changed_backward(d, spec) if spec else base
    cfg = with_fields(TWO_PASS_BWD, spec) if spec else TWO_PASS_BWD
    if cfg.one_pass:
        raise ValueError(
            f"{cfg}: the one-pass backward adds dQ's partial sums in a varying order; "
            "KernelOptions(deterministic=True) takes the two-pass kernel"
        )
    return cfg


# The one-pass backward per head dim: at d = 64 and 80 the register split between the consumers'
# dK/dV accumulators and score tiles and the dQ warpgroup's accumulator (no spills at d = 64 in an
# offline sm_90 compile); at d = 128 dQ in the consumers (240 registers each; two dS^T slots and one
# float32 staging tile keep shared memory at 198 KB: a second staging tile measured no faster), with
# dQ's staging rows interleaved (H100, 32 x 32768 x 128: 0.982x the plain staging's time, 3.7 % fewer
# cycles at base clocks; at d = 80 it measured 1.014x, at d = 64 1.002x: OPTIMIZATION_LOG.md, session 23).
ONE_PASS_CONFIGS = {
    64: WarpSpecializedBwdConfig(block_m=64, stages=2, consumer_regs=200, dq_regs=88),
    80: WarpSpecializedBwdConfig(block_m=64, stages=3, consumer_regs=208, dq_regs=72),
    128: WarpSpecializedBwdConfig(
        block_m=64, stages=2, ds_slots=2, dq_buffers=1, dq_in_consumers=True, dq_rows_interleaved=True
    ),
}
