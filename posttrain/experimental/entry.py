"""What the asynchronous entry points share: verl-style ``key=value`` overrides over the entry's defaults,
then the run as `python -m posttrain.trainer.main_ppo` runs it (one ``error:`` line for a user error)."""

from __future__ import annotations

import sys


def entry_main(prog: str, defaults: tuple[str, ...], argv: list[str] | None = None) -> int:
    from posttrain.errors import run_cli
    from posttrain.trainer.main_ppo import train_cli

    args = list(sys.argv[1:] if argv is None else argv)
    return run_cli(lambda a: train_cli(a, builtin=False, prog=prog, entry_overrides=defaults), args)


def run_as_script(prog: str, defaults: tuple[str, ...]) -> None:
    from posttrain.host.allocator import bound_kernel_caches
    from posttrain.host.threads import choose_wait_policy

    choose_wait_policy()  # torch is not loaded yet (posttrain.host.threads says why)
    bound_kernel_caches()  # before the first matmul (posttrain.host.allocator says why)
    sys.exit(entry_main(prog, defaults))
