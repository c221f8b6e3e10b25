"""Supervised fine-tuning (verl's `fsdp_sft_trainer`): its step and validation, on the run loop every
stage shares (`posttrain.trainer.run`) and an `SFTSession` (rows, loader, workers, checkpoint folder).

One step reads top to bottom: the next ``data.train_batch_size`` rows (RL layout, `posttrain.data.sft`)
-> ``workers.update_actor(batch, SFT())`` (one optimizer step of token-mean NLL over the batch's
trained tokens, split over the ranks) -> validation loss every ``trainer.test_freq`` -> checkpoint every
``trainer.save_freq``. The workers are the RL actor's (`posttrain.workers.group` in one process,
`posttrain.distributed.RankWorkerGroup` on Ray ranks, `posttrain.distributed.TorchrunGroup` on
torchrun's), so checkpoints are RL checkpoints
(``global_step_N/actor``, the tracker, the data loader's position): an exported SFT model starts an
RL run, and a resumed run continues exactly where the stopped one was, at an epoch boundary too
(the loader's state always names the next batch).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from posttrain.algorithms.objectives import SFT
from posttrain.batch import Batch
from posttrain.config.sft import SFTConfig
from posttrain.config.sft_load import validate_sft_config
from posttrain.trainer.sft_session import SFTSession, builtin_sft_files, read_sft_rows

__all__ = ["SFTTrainer"]


class SFTTrainer:
    """SFT on one process, ``trainer.nnodes x trainer.n_gpus_per_node`` Ray ranks, or torchrun's ranks.

    Args:
        config: `posttrain.config.sft_load.load_sft_config(...)`.
        model, tokenizer: use these instead of loading ``model.partial_pretrain`` (tests; one process).
        before_models: called after every check, before any model loads (`SFTSession`).
    """

    stage = "sft"

    def __init__(self, config: SFTConfig, *, model: Any = None, tokenizer: Any = None, before_models: Any = None):
        validate_sft_config(config)
        self.config = config
        self.session = SFTSession(config, read_sft_rows, builtin_sft_files, stage=self.stage, reference=False,
                                  trainer=self, model=model, tokenizer=tokenizer, before_models=before_models)

    def __getattr__(self, name: str) -> Any:
        """The session's parts and run state: workers, tokenizer, train_data, global_step, history, ..."""
        if "session" not in self.__dict__:  # still being built
            raise AttributeError(name)
        return getattr(self.__dict__["session"], name)

    # ------------------------------------------------------------------ one step
    def train_step(self, batch: Batch) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.workers.update_actor(batch, SFT())
        tokens = float(batch["response_mask"].sum())
        metrics.update({"train/trained_tokens": tokens, "timing_s/step": time.perf_counter() - start})
        return metrics

    def validate(self) -> dict[str, float]:
        """``val/loss``: NLL per trained token over the whole validation set."""
        if self.val_data is None:
            return {}
        nll = tokens = 0.0
        for batch in self.session.batches(self.val_data):
            sums = self.workers.compute_sequence_logps(batch).to(torch.float64)  # [N, 2]: log-prob sum, tokens
            nll, tokens = nll - float(sums[:, 0].sum()), tokens + float(sums[:, 1].sum())
        return {"val/loss": nll / max(tokens, 1.0)}

    # ------------------------------------------------------------------ the run (posttrain.trainer.run)
    def fit(self) -> list[dict[str, float]]:
        """Train until `total_steps` (resuming per ``trainer.resume_mode``); returns per-step metrics."""
        return self.session.fit()


def main(argv: list[str] | None = None) -> int:
    """``python -m posttrain.trainer.sft_trainer`` (verl 0.9's ``verl.trainer.sft_trainer``, also under
    torchrun): verl 0.9's engine SFT keys, run as posttrain's SFT (`posttrain.config.sft_engine`)."""
    import sys

    from posttrain.errors import run_cli
    from posttrain.trainer.sft_launch import engine_sft_cli

    return run_cli(lambda a: engine_sft_cli(a, SFTTrainer), list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    import sys

    from posttrain.host.allocator import bound_kernel_caches
    from posttrain.host.threads import choose_wait_policy

    choose_wait_policy()  # torch is not loaded yet (posttrain.host.threads says why)
    bound_kernel_caches()  # before the first matmul (posttrain.host.allocator says why)
    sys.exit(main())
