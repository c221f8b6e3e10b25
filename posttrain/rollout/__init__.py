"""Generation engines behind one interface (``RolloutEngine``): ``hf`` (our KV-cached decoding loop
on the actor's own module) and ``vllm`` (an in-process vLLM engine that receives the actor's
weights after each update, `vllm_engine`); ``sglang`` is a recognised name that fails at start-up.

    engine = get_rollout_engine("hf", model=actor_module, tokenizer=tok, autocast=...)
    out = engine.generate(prompts, SamplingParams.from_rollout_config(cfg.actor_rollout_ref.rollout))
"""

from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.engines import ROLLOUT_ENGINES, get_rollout_engine

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "SamplingParams", "get_rollout_engine", "HFRolloutEngine"]


def __getattr__(name):
    if name == "HFRolloutEngine":  # lazy: keeps `import posttrain.rollout` light
        from posttrain.rollout.hf import HFRolloutEngine

        return HFRolloutEngine
    raise AttributeError(name)
