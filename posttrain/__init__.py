"""posttrain: reinforcement-learning post-training of language models with verl's config keys."""

from posttrain.config import BUILTIN_CONFIG, ConfigError, PostTrainConfig, load_config
from posttrain.errors import PosttrainError

__version__ = "0.1.0"


def __getattr__(name):
    # One trainer under verl's names (RayPPOTrainer too: the trainer uses Ray itself for several ranks).
    # Trainers import torch and transformers; keep `import posttrain` light for `posttrain config`.
    if name in ("GRPOTrainer", "PPOTrainer", "RayPPOTrainer", "RLTrainer"):
        from posttrain.trainer import trainer as _trainer

        return getattr(_trainer, name)
    if name in ("DPOTrainer", "SFTTrainer"):
        import posttrain.trainer as _trainers

        return getattr(_trainers, name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")


__all__ = ["BUILTIN_CONFIG", "ConfigError", "PosttrainError", "PostTrainConfig", "load_config", "GRPOTrainer", "PPOTrainer", "RayPPOTrainer",
           "RLTrainer", "DPOTrainer", "SFTTrainer", "__version__"]
