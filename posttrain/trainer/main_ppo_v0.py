"""``python -m posttrain.trainer.main_ppo_v0 key=value ...`` (verl 0.9's entry for its older trainer,
``verl.trainer.main_ppo_v0``): `python -m posttrain.trainer.main_ppo` with ``trainer.use_v1=False`` first (posttrain
runs it as the synchronous run); the user's overrides come after it."""

from __future__ import annotations

from posttrain.experimental.entry import entry_main, run_as_script

PROG = "python -m posttrain.trainer.main_ppo_v0"
DEFAULTS = ("trainer.use_v1=False",)


def main(argv: list[str] | None = None) -> int:
    return entry_main(PROG, DEFAULTS, argv)


if __name__ == "__main__":
    run_as_script(PROG, DEFAULTS)
