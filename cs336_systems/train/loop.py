"""The training run: checks, process group, model, resume, the loop, metrics and checkpoints.

`train(cfg)` runs on every rank (one process, or each process of a torchrun job). Its order is the
contract: every check of the input (model config, token files and their ids, the checkpoint directory
and a resumable checkpoint's configuration) happens before the process group, the model or any
allocation, so bad input is a clear error and nothing else.

Resume: the newest complete checkpoint (`train.checkpoint`) restores weights, optimizer state, the
step and the generator states; batches are a pure function of (seed, step, rank) ([Note: batches as a
pure function] in `train.data`), so the resumed run continues exactly where the saved one was. The
metrics file is cut back to the checkpoint's step, so it reads as one run.

Per step, rank 0 writes one JSON line: step, loss (mean over the global batch), lr, grad_norm (before
clipping; null with zero2),
tokens_per_s (global), step_time_s, elapsed_s, on GPU mfu (per GPU, bf16 or fp32 datasheet peak,
matmul FLOPs = 3 x `ModelConfig.matmul_flops_per_token`, which counts the full T x T attention),
and val_loss at evaluation steps.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cs336_systems.distributed.process_group import cleanup_process_group, setup_process_group
from cs336_systems.measure.flops import mfu
from cs336_systems.model import BasicsTransformerLM, ModelConfig, get_cosine_lr
from cs336_systems.train import checkpoint as ckpt
from cs336_systems.train.config import TrainConfig
from cs336_systems.train.data import TokenFile, TrainInputError, rank_batch
from cs336_systems.train.parallel import StepChoices, build_engine, local_world_size

# Test hook: the step at whose start rank KILL_RANK_ENV (default 0) SIGKILLs itself, only while
# TORCHELASTIC_RESTART_COUNT is 0 or unset (so the restarted job runs through).
KILL_AT_STEP_ENV = "CS336_TRAIN_TEST_KILL_AT_STEP"
KILL_RANK_ENV = "CS336_TRAIN_TEST_KILL_RANK"


def _world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainInputError("--device cuda, but no GPU is visible")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def fingerprint(cfg: TrainConfig, model_cfg: ModelConfig, choices: StepChoices, world: int) -> dict:
    """What a checkpoint must share with the run that resumes from it."""
    fp = {
        "model": {k: v for k, v in model_cfg.as_kwargs().items()},
        "parallel": cfg.parallel,
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "autocast": choices.autocast,
        "optimizer": choices.optimizer,
    }
    if cfg.parallel in ("zero2", "fsdp", "hsdp"):  # per-rank shards
        fp["world_size"] = world
    if cfg.parallel == "hsdp":
        fp["shard_size"] = local_world_size()
    return fp


def check_inputs(cfg: TrainConfig, world: int) -> dict:
    """Every check that needs no process group or model; returns what the run needs from them."""
    model_cfg = cfg.model_config()
    if cfg.parallel == "none" and world > 1:
        raise TrainInputError(f"{world} ranks with --parallel none: choose ddp, zero2, fsdp or hsdp")
    if cfg.parallel != "none" and "RANK" not in os.environ:
        raise TrainInputError(f"--parallel {cfg.parallel} needs torchrun (python -m torch.distributed.run)")
    if cfg.parallel == "hsdp" and world % local_world_size():
        raise TrainInputError(f"--parallel hsdp: {world} ranks are not whole nodes of {local_world_size()}")
    if cfg.batch_size % world:
        raise TrainInputError(f"--batch-size {cfg.batch_size} does not split evenly over {world} ranks")
    device = resolve_device(cfg)
    choices = StepChoices.resolve(cfg, device)
    triton_on_cpu = device.type != "cuda" and (choices.optimizer == "fused" or cfg.parallel == "zero2")
    if triton_on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise TrainInputError("the fused AdamW kernel on a CPU needs TRITON_INTERPRET=1 (slow; tests only)")
    ctx = model_cfg.context_length
    data = TokenFile(
        cfg.data, cfg.data_dtype, model_cfg.vocab_size, min_tokens=cfg.batch_size * ctx + 1, flag="--data"
    )
    val = None
    if cfg.val_data is not None:
        val = TokenFile(
            cfg.val_data,
            cfg.data_dtype,
            model_cfg.vocab_size,
            min_tokens=cfg.batch_size * ctx + 1,
            flag="--val-data",
        )
    fp = fingerprint(cfg, model_cfg, choices, world)
    resume = None
    if cfg.checkpoint_dir is not None:
        ckpt.check_writable(cfg.checkpoint_dir)
        resume = ckpt.latest_checkpoint(cfg.checkpoint_dir)
        if resume is not None:
            ckpt.check_compatible(resume[2]["fingerprint"], fp, resume[1])
    return dict(model_cfg=model_cfg, device=device, choices=choices, data=data, val=val, fp=fp, resume=resume)


class MetricsLog:
    """Rank 0's JSON lines; on resume the lines after the resumed step are dropped first."""

    def __init__(self, path: str | None, start_step: int, enabled: bool):
        self.file = None
        if path is None or not enabled:
            return
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if start_step and p.exists():
            kept = [
                ln for ln in p.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= start_step
            ]
        p.write_text("".join(ln + "\n" for ln in kept))
        self.file = p.open("a")

    def write(self, row: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _mean_over_ranks(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        t = t.clone()
        dist.all_reduce(t)
        t /= world
    return t


def _maybe_die(step: int, rank: int) -> None:
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    chosen = os.environ.get(KILL_AT_STEP_ENV) == str(step) and os.environ.get(KILL_RANK_ENV, "0") == str(rank)
    if chosen and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)


def train(cfg: TrainConfig) -> dict:
    """Train to `cfg.steps` (resuming if a checkpoint exists); returns the last step's metrics row."""
    rank, world = _world()
    run = check_inputs(cfg, world)  # raises TrainInputError before any work
    model_cfg, device, choices = run["model_cfg"], run["device"], run["choices"]
    if world > 1 or "RANK" in os.environ:
        device = setup_process_group("nccl" if device.type == "cuda" else "gloo")
    rank0 = rank == 0
    if rank0:
        print(
            json.dumps(
                {
                    "train": cfg.to_json(),
                    "model": model_cfg.as_kwargs(),
                    "resolved": vars(choices) | {"device": str(device), "world_size": world},
                }
            ),
            flush=True,
        )
        if cfg.checkpoint_dir is not None:
            ckpt.remove_partial(cfg.checkpoint_dir)

    torch.manual_seed(cfg.seed)
    model = BasicsTransformerLM.from_config(model_cfg, device=device)
    engine = build_engine(model, cfg, choices)
    start = 0
    if run["resume"] is not None:
        step, path, meta = run["resume"]
        state = _checkpoint_state(engine, rank, meta.get("world_size") == world)
        ckpt.load(path, state)
        engine.after_load(state)
        if meta.get("world_size") == world:
            ckpt.set_rng_state(
                {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.startswith(f"rng.rank{rank}.")}
            )
        start = step
        if rank0:
            print(f"resumed from {path} (step {step})", flush=True)

    ctx = model_cfg.context_length
    tokens_per_step = cfg.batch_size * ctx
    flops_per_gpu = 3 * model_cfg.matmul_flops_per_token(ctx) * tokens_per_step / world
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    log = MetricsLog(cfg.metrics, start, rank0)
    show = rank0 and (cfg.progress == "on" or (cfg.progress == "auto" and sys.stderr.isatty()))
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=start, disable=not show, desc="train", unit="step")
    batch_args = dict(
        seed=cfg.seed,
        batch_size=cfg.batch_size,
        context_length=ctx,
        rank=rank,
        world_size=world,
        device=device,
    )
    row: dict = {}
    t_begin = time.perf_counter()
    for step in range(start + 1, cfg.steps + 1):
        _maybe_die(step, rank)
        t0 = time.perf_counter()
        x, y = rank_batch(run["data"], key=0, index=step, **batch_args)
        # the cycle ends at the last step; a run no longer than its warmup keeps a one-step cycle
        lr = get_cosine_lr(step, cfg.lr, cfg.final_lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1))
        loss, norm = engine.train_step(x, y, lr, cfg.grad_clip)
        loss = _mean_over_ranks(loss.float(), world).item()  # one host sync per step
        dt = time.perf_counter() - t0
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"step {step}: loss is {loss}; stopping (lower --lr or raise --grad-clip)"
            )
        row = dict(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=None if norm is None else float(norm),
            tokens_per_s=tokens_per_step / dt,
            step_time_s=dt,
            elapsed_s=time.perf_counter() - t_begin,
        )
        if device_name is not None:
            row["mfu"] = mfu(
                flops_per_gpu, dt * 1e3, device_name, torch.bfloat16 if choices.autocast else torch.float32
            )
        if run["val"] is not None and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            row["val_loss"] = _validate(engine, run["val"], cfg, batch_args, world)
        log.write(row)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if cfg.checkpoint_dir is not None and (
            step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        ):
            train_state = {"fingerprint": run["fp"], "world_size": world, "config": cfg.to_json()}
            ckpt.save(
                cfg.checkpoint_dir,
                step,
                _checkpoint_state(engine, rank, True),
                train_state,
                keep=cfg.keep_checkpoints,
            )
    bar.close()
    log.close()
    if rank0 and row:
        print(json.dumps({"final": row}), flush=True)
    cleanup_process_group()
    return row


def _checkpoint_state(engine, rank: int, with_rng: bool) -> dict[str, torch.Tensor]:
    state = engine.state()
    if with_rng:
        state |= {f"rng.rank{rank}.{k}": v for k, v in ckpt.rng_state().items()}
    return state


@torch.no_grad()
def _validate(engine, val: TokenFile, cfg: TrainConfig, batch_args: dict, world: int) -> float:
    losses = [
        engine.eval_loss(*rank_batch(val, key=1, index=i, **batch_args)).float()
        for i in range(cfg.eval_batches)
    ]
    return _mean_over_ranks(torch.stack(losses).mean(), world).item()
