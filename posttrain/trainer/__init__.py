"""The training loops and what surrounds them: setup, metrics, validation, checkpoints, export.

``from posttrain.trainer import PPOTrainer, GRPOTrainer, DPOTrainer, SFTTrainer`` (the names verl's
tutorials use; PPO and GRPO are the one RL trainer, the algorithm chosen by config).
"""

_TRAINERS = {"PPOTrainer": "trainer", "GRPOTrainer": "trainer", "RayPPOTrainer": "trainer", "RLTrainer": "trainer",
             "DPOTrainer": "dpo_trainer", "SFTTrainer": "sft_trainer"}


def __getattr__(name):
    # lazy: the trainers import torch and transformers
    if name in _TRAINERS:
        import importlib

        return getattr(importlib.import_module(f"posttrain.trainer.{_TRAINERS[name]}"), name)
    raise AttributeError(f"module 'posttrain.trainer' has no attribute {name!r}")
