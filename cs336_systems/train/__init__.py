"""`python -m cs336_systems.train`: train a `BasicsTransformerLM` on a token file, from one process to
several nodes under torchrun, with sharded DCP checkpoints and exact resume (an application on top of
the library; nothing in the library imports it).

* `config`: `TrainConfig` and the command line built from its fields.
* `data`: memmapped token files and each step's batch as a pure function of (seed, step, rank).
* `checkpoint`: atomic DCP checkpoints, the newest complete one found and checked on start.
* `parallel`: the step on this rank: none / ddp (bucketed) / zero2 / fsdp from the library's pieces.
* `loop`: `train(cfg)`: checks, process group, model, resume, steps, metrics, checkpoints.
* `make_tokens`: a generated token file with learnable structure (GPU demos, tests).
"""

from cs336_systems.train.config import TrainConfig, build_parser, parse_args
from cs336_systems.train.data import TrainInputError, write_tokens
from cs336_systems.train.loop import train

__all__ = ["TrainConfig", "TrainInputError", "build_parser", "main", "parse_args", "train", "write_tokens"]


def main(argv: list[str] | None = None) -> dict:
    """The command line: parse, train; bad input exits with status 2 and one line naming the problem."""
    import sys

    cfg = parse_args(argv)
    try:
        return train(cfg)
    except TrainInputError as exc:
        print(f"python -m cs336_systems.train: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
