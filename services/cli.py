"""The `offpolicy` command line: quickstart, learner, actor, make-tiny-model, bench."""

from __future__ import annotations

import argparse
import sys


def _make_tiny_model(args: argparse.Namespace) -> int:
    from learner.model import make_tiny_model

    out = make_tiny_model(args.dir, seed=args.seed)
    print(f"tiny model written to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offpolicy",
        description="Asynchronous replay-buffer off-policy RL training for LLMs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random Llama + character tokenizer to DIR")
    tiny.add_argument("dir", help="output folder (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="torch seed for the random weights")
    tiny.set_defaults(func=_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
