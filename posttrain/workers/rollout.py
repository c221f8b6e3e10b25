"""The rollout engines under the names verl's tutorials import: ``from posttrain.workers.rollout
import HFRollout, vLLMRollout, SGLangRollout``.

``HFRollout`` is `posttrain.rollout.hf.HFRolloutEngine` (decoding with the actor's own module) and
``vLLMRollout`` is `posttrain.rollout.vllm_engine.VLLMRolloutEngine` (vLLM is imported only when an
engine is built). Both take ``(model, tokenizer, ...)`` and ``generate(prompts, SamplingParams)``;
in a training run the trainer builds them from ``actor_rollout_ref.rollout.name``. These are
posttrain's engines under verl's names, not verl's classes (verl's own now live behind its
``ServerAdapter``). ``SGLangRollout`` imports, so that a tutorial's import line works, but building
one raises NotImplementedError saying SGLang is not supported and what to use instead.
"""

from __future__ import annotations

__all__ = ["HFRollout", "vLLMRollout", "SGLangRollout"]


class SGLangRollout:
    """verl's name for its SGLang engine. posttrain has none: constructing this raises
    NotImplementedError naming the engines that exist (``hf``, ``vllm``)."""

    def __init__(self, *args, **kwargs):
        from posttrain.rollout.engines import SGLANG_MISSING

        raise NotImplementedError(f"SGLangRollout: {SGLANG_MISSING}. Use HFRollout (actor_rollout_ref.rollout.name=hf) "
                                  "or vLLMRollout (rollout.name=vllm) instead.")


def __getattr__(name: str):
    if name == "HFRollout":
        from posttrain.rollout.hf import HFRolloutEngine

        return HFRolloutEngine
    if name == "vLLMRollout":
        from posttrain.rollout.vllm_engine import VLLMRolloutEngine  # imports vllm lazily, when built

        return VLLMRolloutEngine
    raise AttributeError(f"module 'posttrain.workers.rollout' has no attribute {name!r}")
