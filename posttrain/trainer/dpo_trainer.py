"""Offline DPO (TRL's `DPOTrainer` semantics and names): its step and validation, on the run loop every
stage shares (`posttrain.trainer.run`) and an `SFTSession` of preference pairs (rows, loader, the RL
workers, checkpoint folder), composed rather than inherited from SFT.

One step: the next ``data.train_batch_size`` preference pairs (read and checked row by row by
`posttrain.data.preference.PreferenceDataset`, the one reader of preference rows; chosen and
rejected collated as adjacent rows sharing their prompt) -> the reference's summed log-probs of each
response (``workers.compute_ref_sequence_logps``, or the values computed once before training with
``dpo.precompute_ref_log_probs``) -> ``workers.update_actor(batch, objective)`` (one optimizer step of
the objective `dpo.*` asks for, over all pairs of all ranks: `posttrain.algorithms.objectives.DPO`,
given each response's token count, which ``ipo`` averages by) -> metrics under TRL's names
(`posttrain.algorithms.dpo.dpo_metrics`). Without ``data.train_files`` (the built-in run) the pairs are the
model's own samples on the built-in task, paired by their scores (``data.self_pairs.*``, `self_pairs`).

``dpo.loss_type=simpo`` is SimPO (TRL's ``CPOTrainer`` with ``loss_type="simpo"``, ``simpo_gamma``,
``cpo_alpha``): the objective `posttrain.algorithms.objectives.SimPO` compares the policy's
length-averaged log-probs of chosen and rejected with no reference, so no reference model loads and
no reference log-probs are computed.

The reference is the starting policy: a frozen copy (full fine-tuning), the actor with its LoRA
adapters disabled (no second model), or, with ``precompute_ref_log_probs``, no model at all: the
log-probs are computed from the starting weights before any step (and before a resume loads later
weights, so a resumed run uses the same reference).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from posttrain.algorithms.dpo import dpo_metrics
from posttrain.batch import Batch
from posttrain.config.sft import DPOConfig
from posttrain.config.sft_load import validate_sft_config
from posttrain.trainer.sft_session import SFTSession

__all__ = ["DPOTrainer"]


class DPOTrainer:
    """Preference pairs and the DPO loss (``dpo.*``) on an `SFTSession`, run by `RunLoop`.

    Args:
        config: `posttrain.config.sft_load.load_dpo_config(...)`.
        model, tokenizer: use these instead of loading ``model.partial_pretrain`` (tests; one process).
        before_models: called after every check, before any model loads (`SFTSession`).
    """

    stage = "dpo"

    def __init__(self, config: DPOConfig, *, model: Any = None, tokenizer: Any = None, before_models: Any = None):
        self.objective = config.dpo.objective()  # DPO, or SimPO (no reference), checked before anything loads
        validate_sft_config(config)
        self.config = config
        reference = self.objective.needs_reference and not config.dpo.precompute_ref_log_probs
        self.session = SFTSession(config, read_pairs, self_pairs, stage=self.stage, reference=reference,
                                  trainer=self, model=model, tokenizer=tokenizer, before_models=before_models)
        if config.dpo.precompute_ref_log_probs:
            for dataset in (self.train_data, self.val_data):
                if dataset is not None:
                    self._precompute(dataset)

    def __getattr__(self, name: str) -> Any:
        """The session's parts and run state: workers, tokenizer, train_data, global_step, history, ..."""
        if "session" not in self.__dict__:  # still being built
            raise AttributeError(name)
        return getattr(self.__dict__["session"], name)

    def _batches(self, dataset: Any) -> Iterator[Batch]:
        return self.session.batches(dataset)

    def _precompute(self, dataset: Any) -> None:
        """Each pair's summed log-probs (chosen, rejected) under the starting policy, stored in ``dataset``."""
        sums = [self.workers.compute_sequence_logps(batch)[:, 0] for batch in self._batches(dataset)]
        dataset.set_reference_logps(torch.cat(sums).reshape(len(dataset), 2))

    def _reference_logps(self, batch: Batch) -> torch.Tensor | None:
        if not self.objective.needs_reference:
            return None
        if "ref_logps" in batch:
            return batch["ref_logps"]
        return self.workers.compute_ref_sequence_logps(batch)[:, 0].to(torch.float32)

    # ------------------------------------------------------------------ one step
    def train_step(self, batch: Batch) -> dict[str, float]:
        import time

        start = time.perf_counter()
        if self.objective.needs_reference:
            batch["ref_logps"] = self._reference_logps(batch)
        metrics = self.workers.update_actor(batch, self.objective)
        metrics["timing_s/step"] = time.perf_counter() - start
        return metrics

    def validate(self) -> dict[str, float]:
        """The objective's loss and TRL's metrics of the held-out pairs under the current policy (no
        update), in float64: ``eval_loss``, ``eval_rewards/*``, ``eval_logps/*`` (means over all pairs;
        SimPO with ``cpo_alpha`` also ``eval_nll_loss``, the chosen responses' NLL per token)."""
        if self.val_data is None:
            return {}
        sums: dict[str, float] = {}
        chosen_nll = chosen_tokens = 0.0
        for batch in self._batches(self.val_data):
            ref = self._reference_logps(batch)
            policy = self.workers.compute_sequence_logps(batch).to(torch.float64)  # [2B, 2]: sum, response tokens
            losses, *stats = self.objective.pair_losses(policy[:, 0], policy[:, 1],
                                                        None if ref is None else ref.to(torch.float64))
            pairs = len(losses)  # dpo_metrics are means over this batch's pairs: weigh them by its size
            means = {"loss": losses.mean(), **dpo_metrics(*stats)}
            for name, mean in means.items():
                sums[f"eval_{name}"] = sums.get(f"eval_{name}", 0.0) + float(mean) * pairs
            chosen_nll, chosen_tokens = chosen_nll - float(policy[0::2, 0].sum()), chosen_tokens + float(policy[0::2, 1].sum())
        out = {name: total / len(self.val_data) for name, total in sums.items()}
        if getattr(self.objective, "cpo_alpha", 0.0):
            out["eval_nll_loss"] = chosen_nll / max(chosen_tokens, 1.0)
            out["eval_loss"] += self.objective.cpo_alpha * out["eval_nll_loss"]
        return out

    # ------------------------------------------------------------------ the run (posttrain.trainer.run)
    def fit(self) -> list[dict[str, float]]:
        """Train until `total_steps` (resuming per ``trainer.resume_mode``); returns per-step metrics."""
        return self.session.fit()


def read_pairs(files: Any, tokenizer: Any, config: DPOConfig, max_samples: int) -> Any:
    from posttrain.data.preference import PreferenceDataset

    return PreferenceDataset.from_data_config(files, tokenizer, config.data, max_samples)


def self_pairs(config: DPOConfig) -> tuple[Any, Any]:
    """``data.train_files`` null: pairs from the model's own samples (`posttrain.commands.pairs.self_pairs_file`);
    no held-out pairs unless ``data.val_files`` names some."""
    from posttrain.commands.pairs import self_pairs_file

    return self_pairs_file(config), None
