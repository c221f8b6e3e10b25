"""Engine selection by name (``actor_rollout_ref.rollout.name``): the one module that knows every
engine, so that the engines and their shared interface (`posttrain.rollout.base`) import nothing
back from here.
"""

from __future__ import annotations

from typing import Any

from posttrain.rollout.base import RolloutEngine

__all__ = ["ROLLOUT_ENGINES", "SGLANG_MISSING", "get_rollout_engine"]

ROLLOUT_ENGINES = ("hf", "vllm", "sglang")


def get_rollout_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine named by ``actor_rollout_ref.rollout.name``; kwargs go to its constructor.

    ``hf`` -> :class:`posttrain.rollout.hf.HFRolloutEngine` (``model``, ``tokenizer``, ``autocast``;
    ``config.lean_decode=False`` turns its lean decoder off).
    ``vllm`` -> :class:`posttrain.rollout.vllm_engine.VLLMRolloutEngine` (the same, plus ``config``
    and ``seed``); RuntimeError naming the install command when vLLM is not importable.
    ``sglang`` fails at start-up: there is no SGLang engine yet.
    """
    if name == "hf":
        from posttrain.rollout.hf import HFRolloutEngine

        config = kwargs.pop("config", None)
        kwargs.pop("seed", None)
        if config is not None:  # rollout.lean_decode=False: the model's own forward at every decoding step
            kwargs.setdefault("lean_decode", bool(getattr(config, "lean_decode", True)))
        return HFRolloutEngine(**kwargs)
    if name == "vllm":
        from posttrain.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(**kwargs)
    if name == "sglang":
        raise NotImplementedError(SGLANG_MISSING)
    raise ValueError(f"unknown actor_rollout_ref.rollout.name={name!r}; valid: {ROLLOUT_ENGINES}")


SGLANG_MISSING = ("actor_rollout_ref.rollout.name=sglang: posttrain has no SGLang engine (one would need SGLang's "
                  "in-process Engine with weight updates from tensors and memory release, and nothing here tests "
                  "it); use actor_rollout_ref.rollout.name=vllm or hf")
