"""`python -m cs336_systems.train.make_tokens OUT`: write a generated token file (see `data.write_tokens`)."""

from __future__ import annotations

import argparse

from cs336_systems.train.data import write_tokens


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help; the example kept as written."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m cs336_systems.train.make_tokens",
        description=__doc__,
        epilog="example:\n  python -m cs336_systems.train.make_tokens tokens.bin --num-tokens 1000000 --vocab-size 256",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("out", help="the token file to write")
    p.add_argument("--num-tokens", type=int, default=10_000_000, help="tokens in the file")
    p.add_argument("--vocab-size", type=int, default=10_000, help="ids are in [0, vocab size)")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16", help="dtype of the ids")
    p.add_argument("--seed", type=int, default=0, help="generator seed")
    a = p.parse_args(argv)
    try:
        path = write_tokens(a.out, a.num_tokens, a.vocab_size, seed=a.seed, dtype=a.data_dtype)
    except ValueError as exc:
        p.error(str(exc))
    print(f"wrote {a.num_tokens} tokens (vocab {a.vocab_size}, {a.data_dtype}) to {path}")


if __name__ == "__main__":
    main()
