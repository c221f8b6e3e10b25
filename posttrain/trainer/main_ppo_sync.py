"""``python -m posttrain.trainer.main_ppo_sync key=value ...`` (verl's synchronous PPO entry,
``verl.trainer.main_ppo_sync``): `python -m posttrain.trainer.main_ppo` with ``trainer.v1.trainer_mode=sync``
first, so generation and training alternate on the same devices; the user's overrides come after it."""

from __future__ import annotations

from posttrain.experimental.entry import entry_main, run_as_script

PROG = "python -m posttrain.trainer.main_ppo_sync"
DEFAULTS = ("trainer.v1.trainer_mode=sync",)


def main(argv: list[str] | None = None) -> int:
    return entry_main(PROG, DEFAULTS, argv)


if __name__ == "__main__":
    run_as_script(PROG, DEFAULTS)
