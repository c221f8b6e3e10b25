"""``torchrun ... tests/helpers/rank_dies.py <posttrain sft overrides>``: `posttrain sft`'s torchrun entry, with
the rank named by $DIE_RANK killed (SIGKILL: no clean-up) as it starts step $DIE_STEP, a rank lost mid-run."""

import os
import signal
import sys

from posttrain.trainer import sft_trainer
from posttrain.trainer.fsdp_sft_trainer import main

DIE_RANK, DIE_STEP = int(os.environ["DIE_RANK"]), int(os.environ["DIE_STEP"])
_train_step = sft_trainer.SFTTrainer.train_step


def train_step(self, batch):
    if int(os.environ["RANK"]) == DIE_RANK and self.global_step + 1 == DIE_STEP:
        os.kill(os.getpid(), signal.SIGKILL)
    return _train_step(self, batch)


if __name__ == "__main__":
    sft_trainer.SFTTrainer.train_step = train_step
    sys.exit(main(sys.argv[1:]))
