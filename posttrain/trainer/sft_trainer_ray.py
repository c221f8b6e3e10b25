"""``python -m posttrain.trainer.sft_trainer_ray key=value ...`` (verl 0.9's ``verl.trainer.sft_trainer_ray``: the
engine SFT with its ranks placed by Ray): the same run as `python -m posttrain.trainer.sft_trainer`, whose ranks
are Ray's (``trainer.nnodes`` x ``trainer.n_gpus_per_node``) whenever it is not started by torchrun."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from posttrain.errors import run_cli
    from posttrain.trainer.sft_launch import engine_sft_cli
    from posttrain.trainer.sft_trainer import SFTTrainer

    args = list(sys.argv[1:] if argv is None else argv)
    return run_cli(lambda a: engine_sft_cli(a, SFTTrainer, prog="python -m posttrain.trainer.sft_trainer_ray"), args)


if __name__ == "__main__":
    from posttrain.host.allocator import bound_kernel_caches
    from posttrain.host.threads import choose_wait_policy

    choose_wait_policy()  # torch is not loaded yet (posttrain.host.threads says why)
    bound_kernel_caches()  # before the first matmul (posttrain.host.allocator says why)
    sys.exit(main())
