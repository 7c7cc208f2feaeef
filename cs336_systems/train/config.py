"""`TrainConfig`: every choice of a training run, and the command line built from its fields.

Each field carries its help text (and choices) in its metadata, so `--help` and the dataclass cannot
drift apart. The model is a preset of `cs336_systems.model.MODEL_SIZES` (`--size`) or a JSON file of
`ModelConfig` fields (`--config`); `--context-length` overrides the model's.

[Note: flag names under torchrun]
`torchrun ... -m cs336_systems.train --flag` hands `--flag` to torchrun's own argparse first, and
argparse accepts abbreviations: a flag that is a prefix of a torchrun option (`--log` of `--log-dir`,
`--max` of `--max-restarts`, `--node` of `--node-rank`, `--master`, `--rdzv`, `--run`, `--local`,
`--nproc`, `--standalone`, `--start`...) is taken by torchrun and the launch fails. No flag here is
such a prefix; `tests/test_train.py` checks every flag against torchrun's option list.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from cs336_systems.model import ATTENTION_IMPLS, MODEL_SIZES, ModelConfig, get_config

PARALLEL = ("none", "ddp", "zero2", "fsdp", "hsdp")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")  # bf16: autocast over float32 master weights
OPTIMIZERS = ("auto", "reference", "fused")
TOGGLES = ("auto", "on", "off")
DATA_DTYPES = ("uint16", "uint32")


def _f(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run (`python -m cs336_systems.train --help` lists the same fields as flags)."""

    # model and data
    size: str | None = _f("debug", "model preset", choices=tuple(MODEL_SIZES))
    config: str | None = _f(None, "JSON file of ModelConfig fields (instead of --size)", metavar="FILE")
    context_length: int | None = _f(None, "tokens per sequence (default: the model's context length)")
    data: str = _f(None, "flat binary file of token ids (NumPy memmap)", metavar="FILE", required=True)
    data_dtype: str = _f("uint16", "dtype of the token files", choices=DATA_DTYPES)
    val_data: str | None = _f(None, "token file for the validation loss", metavar="FILE")
    eval_every: int = _f(0, "steps between validation losses (0: only at the end, with --val-data)")
    eval_batches: int = _f(4, "batches per validation loss")
    # optimisation
    steps: int = _f(1000, "optimizer steps in total (a resumed run continues to this step)")
    batch_size: int = _f(32, "global batch in sequences, split evenly over the ranks")
    lr: float = _f(3e-4, "peak learning rate (AdamW, cosine schedule)")
    min_lr: float | None = _f(None, "final learning rate (default: lr / 10)")
    warmup_steps: int | None = _f(None, "linear warmup steps (default: 5%% of --steps)")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0: no clipping)")
    seed: int = _f(0, "seed of the initial weights and of every batch")
    # checkpoints and logs
    checkpoint_dir: str | None = _f(
        None, "directory of the checkpoints (none: no checkpoints)", metavar="DIR"
    )
    checkpoint_every: int = _f(0, "steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = _f(3, "complete checkpoints kept (the oldest are deleted)")
    metrics: str | None = _f(None, "JSON lines of per-step metrics, written by rank 0", metavar="FILE")
    progress: str = _f("auto", "progress bar on rank 0 (auto: when stderr is a terminal)", choices=TOGGLES)
    # how the step runs
    device: str = _f("auto", "where to train (auto: cuda if present)", choices=DEVICES)
    parallel: str = _f(
        "none",
        "data parallelism over the ranks (hsdp: fsdp within each node, replicas across nodes)",
        choices=PARALLEL,
    )
    precision: str = _f("auto", "auto: bf16 autocast on GPU, fp32 on CPU", choices=PRECISIONS)
    optimizer: str = _f("auto", "AdamW implementation (auto: fused on GPU)", choices=OPTIMIZERS)
    attention: str = _f("sdpa", "attention implementation", choices=tuple(ATTENTION_IMPLS))
    compile: str = _f("auto", "torch.compile each block (auto: on GPU)", choices=TOGGLES)
    fused_loss: str = _f("auto", "chunked LM head + loss (auto: on GPU, not with fsdp)", choices=TOGGLES)
    bucket_size_mb: float = _f(25.0, "DDP bucket size in MiB")

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "eval_batches", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "grad_clip", "weight_decay", "lr"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"--warmup-steps must be in [0, --steps], got {self.warmup_steps}")
        if self.context_length is not None and self.context_length <= 0:
            raise ValueError(f"--context-length must be positive, got {self.context_length}")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError("--checkpoint-every needs --checkpoint-dir")

    # ---- derived -------------------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        """The model's hyperparameters: the preset or the JSON file, with --context-length applied."""
        overrides = {} if self.context_length is None else {"context_length": self.context_length}
        if self.config is None:
            return get_config(self.size, **overrides)
        path = Path(self.config)
        try:
            fields = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--config {path}: cannot read a JSON object ({exc})") from None
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(fields) - known)
        if not isinstance(fields, dict) or unknown:
            raise ValueError(f"--config {path}: unknown ModelConfig fields {unknown}; known: {sorted(known)}")
        return ModelConfig(**{**fields, **overrides})

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def warmup(self) -> int:
        return max(1, self.steps // 20) if self.warmup_steps is None else self.warmup_steps

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cs336_systems.train",
        description="Train a BasicsTransformerLM on a token file: one process, or every rank of a torchrun "
        "job (one GPU to several nodes). Resumes from the latest complete checkpoint in --checkpoint-dir.",
        epilog="example:\n"
        "  python -m cs336_systems.train --size debug --data tokens.bin --steps 30 --batch-size 4 \\\n"
        "      --context-length 64 --checkpoint-dir ckpt --checkpoint-every 10 --metrics metrics.jsonl "
        "--device cpu\n"
        "several nodes (the same command on each; see the README for TORCH_DISABLE_SHARE_RDZV_TCP_STORE):\n"
        "  torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\\n"
        "      --max-restarts 3 -m cs336_systems.train --parallel ddp ...same flags...",
        formatter_class=_HelpFormatter,
    )
    for f in dataclasses.fields(TrainConfig):
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        p.add_argument(
            f"--{_flag(f.name)}", dest=f.name, type=kind, default=f.default, help=help_text, **meta
        )
    return p


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help; the examples kept as written."""


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The run's configuration from the command line (usage errors exit with status 2)."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
        cfg.model_config()
    except ValueError as exc:
        p.error(str(exc))
    return cfg
