"""``python -m posttrain.trainer.main_generation`` (older verl's ``verl.trainer.main_generation``): as
``main_generation_server``, posttrain has no module of that name; running it says what to use and exits 2."""

from __future__ import annotations

import sys

from posttrain.trainer.main_generation_server import refuse


def main(argv: list[str] | None = None) -> int:
    return refuse("main_generation")


if __name__ == "__main__":
    sys.exit(main())
