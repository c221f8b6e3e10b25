"""``posttrain prep``: the data room's preparations (`posttrain.data.prep`: gsm8k, math, arithmetic,
SFT rows) and ``prep pairs`` (`posttrain.commands.pairs`), which loads a model, so the data room
cannot offer it itself.
"""

from __future__ import annotations

import argparse
import sys

from posttrain.commands.pairs import add_pairs_parser
from posttrain.commands.tool_prep import add_tool_arithmetic_parser
from posttrain.data import prep as data_prep

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    return data_prep.build_parser(add_pairs_parser, add_tool_arithmetic_parser)


def main(argv: list[str] | None = None) -> int:
    """Run one preparation; returns 0, or 2 with the error printed for bad input (as `posttrain.data.prep`)."""
    return data_prep.main(argv, build_parser())


if __name__ == "__main__":
    from posttrain.errors import run_cli

    raise SystemExit(run_cli(main, sys.argv[1:]))
