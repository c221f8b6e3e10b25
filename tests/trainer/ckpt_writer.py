"""Helper of test_checkpoint.py: checkpoint writers for the test to kill with SIGKILL.

`python ckpt_writer.py ROOT` imports torch once, then for each stdin line START forks a child that
saves START, START+1, ... into ROOT forever, prints the child's pid, and prints "reaped" once the
child is dead. Forking from this warm parent makes each kill cost milliseconds instead of a torch import.
Every tensor of checkpoint N holds the value N, so a reader can check that a checkpoint is self-consistent.
"""

from __future__ import annotations

import os
import sys

import torch

from posttrain.checkpoint import CheckpointManager, RoleState

SHAPE = (128, 1024)  # 512 KiB of float32


def roles_for(step: int) -> dict[str, RoleState]:
    value = float(step)
    model = {f"layer{i}.weight": torch.full(SHAPE, value) for i in range(3)}
    model["lm_head.weight"] = model["layer0.weight"]  # tied: saved as a copy
    optimizer = {"state": {0: {"step": torch.tensor(value), "exp_avg": torch.full(SHAPE, value)}},
                 "param_groups": [{"lr": value, "betas": (0.9, 0.999), "params": [0]}]}
    actor = RoleState(model=model, optimizer=optimizer, scheduler={"last_epoch": step})
    critic = RoleState(model={"value_head.weight": torch.full(SHAPE, value)}, scheduler={"last_epoch": step})
    return {"actor": actor, "critic": critic}


def write_forever(root: str, start: int) -> None:
    manager = CheckpointManager(root, max_actor_ckpt_to_keep=2, max_critic_ckpt_to_keep=1)
    step = start
    while True:
        manager.save(step, roles_for(step), {"step": step, "sampler": {"epoch": 0, "index": step}})
        step += 1


def main() -> None:
    root = sys.argv[1]
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                write_forever(root, int(line))
            finally:
                os._exit(1)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)


if __name__ == "__main__":
    main()
