"""verl 0.9.1's keys that posttrain has no field for: where each one goes, or why it does nothing here.

posttrain follows verl 0.9.1's config. Most of verl's keys are fields of posttrain's own tree
(`posttrain.config.schema`) and mean what they mean in verl. The rest fall into three kinds:

- **aliases**: a verl 0.9 spelling of a key posttrain has under its older name (``critic.fsdp.*`` is
  ``critic.model.fsdp_config.*``; the legacy ``reward_model.rollout.*`` is ``reward.reward_model.rollout.*``).
  The loader rewrites the key and sets the field.
- **no effect**: a setting for hardware, a back-end or a tool posttrain does not run (CUDA graphs, NPU
  profilers, verl's TransferQueue, FSDP1-only switches). It is read, kept in ``no_effect`` and listed
  once at start-up and by `posttrain plan` with its reason, never silently dropped.
- **refused unless off**: a switch that would change what is trained or needs a back-end posttrain lacks
  (Megatron's multi-token prediction, quantization-aware training, SGLang's disaggregation). Its off value
  has no effect; any other value is one error naming what it needs and what to use instead.

A test (``tests/config/test_verl_keys.py``) holds the names of every verl 0.9.1 PPO and SFT key and finds each one
known; `docs/config.md` lists each key with its status.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

__all__ = ["NO_EFFECT", "PPO_ALIASES", "SFT_ALIASES", "SFT_NO_EFFECT", "VerlRule", "alias_of", "rule_for"]

VERL_VERSION = "0.9.1"
"""The verl release whose keys posttrain follows."""


@dataclass(frozen=True)
class VerlRule:
    """What a verl key with no posttrain field does here."""

    pattern: str
    """Glob over the dotted key (``*`` spans dots)."""
    reason: str
    """Why it has no effect here (or, with ``accepts``, what a refused value needs)."""
    accepts: Optional[tuple[Any, ...]] = None
    """None: any value has no effect. Otherwise the values that have no effect; any other is refused."""
    instead: str = ""
    """For a refused value: what to set instead."""

    def refuses(self, value: Any) -> bool:
        return self.accepts is not None and value not in self.accepts

    def refusal(self, key: str, value: Any) -> str:
        return f"{key}={value!r}: {self.reason}" + (f"; {self.instead}" if self.instead else "")


_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "actor_rollout_ref.rollout", "reward_model",
          "reward.reward_model")

_PROFILER = ("verl's profiler hooks (nsys, NPU, torch.profiler, memory snapshots, precision debugger) are not "
             "in posttrain: each step's phases are timed in metrics.jsonl (timing_s/*) and peak memory is printed")
_GPU_ENGINE = "a GPU serving-engine knob (vLLM/SGLang on CUDA); posttrain's engines read what they need elsewhere"
_SEQ_PAR = ("Ulysses sequence parallelism splits each sequence over ranks to save activation memory; posttrain keeps "
            "whole sequences on each rank (the same updates, more memory per rank)")
_ENTROPY = "posttrain's log-prob head computes entropy by chunks with its own backward (posttrain.models.logprobs)"
_FSDP1 = "an FSDP1 or verl-engine switch; posttrain shards with FSDP2 (fully_shard) and its own engine"
_OFF = (False, None, 0, "", [], {})

NO_EFFECT: tuple[VerlRule, ...] = (
    # whole sections for tools posttrain does not run
    VerlRule("global_profiler.*", _PROFILER),
    VerlRule("*.profiler.*", _PROFILER),
    VerlRule("transfer_queue.enable", "verl's TransferQueue data plane; posttrain moves batches in process or "
             "through Ray's object store, so nothing changes either way"),
    VerlRule("transfer_queue.*", "settings of verl's TransferQueue, which posttrain does not use"),
    VerlRule("skip.*.enable", "verl's SkipManager replays rollouts dumped by an earlier run; posttrain has no replay",
             accepts=_OFF, instead="set it False (to look at a run's samples: trainer.rollout_data_dir)"),
    VerlRule("skip.*", "settings of verl's SkipManager (rollout replay), which posttrain does not have"),
    # FSDP engine switches (actor, ref, critic; verl 0.9's engine config)
    VerlRule("*.fsdp_config.ulysses_sequence_parallel_size", _SEQ_PAR),
    VerlRule("*.fsdp_config.entropy_from_logits_with_chunking", _ENTROPY),
    VerlRule("*.fsdp_config.entropy_from_logits_chunk_size", _ENTROPY),
    VerlRule("*.fsdp_config.entropy_checkpointing", _ENTROPY),
    VerlRule("*.entropy_from_logits_chunk_size", _ENTROPY),
    VerlRule("*.fsdp_config.use_torch_compile", "compiling is the role's use_torch_compile key (actor) and "
             "model.compile_layers here"),
    VerlRule("*.fsdp_config.use_orig_params", _FSDP1),
    VerlRule("*.fsdp_config.use_no_sync_for_gradient_accumulation", _FSDP1),
    VerlRule("*.fsdp_config.forward_only", _FSDP1),
    VerlRule("*.fsdp_config.strategy", "the role's strategy key decides (fsdp and fsdp2 are both FSDP2 here)"),
    VerlRule("*.fsdp_config.dtype", "the compute dtype is fsdp_config.mixed_precision.param_dtype here (bf16 where "
             "the CPU or GPU computes in bf16)"),
    VerlRule("*.fsdp_config.seed", "weights initialise from the checkpoint; the run's randomness follows trainer.seed"),
    VerlRule("*.fsdp_config.full_determinism", "a one-process CPU run is bit-reproducible from trainer.seed "
             "already; CUDA's deterministic kernels are not switched"),
    VerlRule("*.fsdp_config.pad_to_length", "posttrain packs or pads micro-batches itself (use_remove_padding, "
             "use_dynamic_bsz)"),
    VerlRule("*.fsdp_config.pad_to_length_bucket", "posttrain packs or pads micro-batches itself"),
    VerlRule("*.pad_to_length", "posttrain packs or pads micro-batches itself"),
    VerlRule("*.fsdp_config.qat.enable", "quantization-aware training needs verl's QAT engine (GPU kernels)",
             accepts=_OFF, instead="set it False"),
    VerlRule("*.fsdp_config.qat.*", "settings of quantization-aware training, which posttrain does not have"),
    VerlRule("*.qat.enable", "quantization-aware training needs verl's QAT engine (GPU kernels)",
             accepts=_OFF, instead="set it False"),
    VerlRule("*.qat.*", "settings of quantization-aware training, which posttrain does not have"),
    VerlRule("*.fsdp_config.turbo_config.*", "settings of verl's fsdp_turbo engine, which posttrain does not have "
             "(strategy=fsdp_turbo is refused)"),
    VerlRule("actor_rollout_ref.ref.fsdp_config.optimizer_offload", "the reference has no optimizer"),
    VerlRule("actor_rollout_ref.ref.fsdp_config.offload_policy", "the reference is paged between passes by "
             "posttrain itself (fsdp_config.param_offload)"),
    VerlRule("actor_rollout_ref.ref.fsdp_config.fsdp_size", "the reference is sharded like the actor"),
    # role keys verl copies from elsewhere or uses for its own bookkeeping
    VerlRule("*.rollout_n", "verl copies actor_rollout_ref.rollout.n here; posttrain reads rollout.n itself"),
    VerlRule("*.data_loader_seed", "mini-batch shuffling follows trainer.seed here"),
    VerlRule("actor_rollout_ref.actor.calculate_entropy", "entropy is computed where it is used (entropy_coeff, "
             "the actor/entropy metric)"),
    VerlRule("actor_rollout_ref.actor.checkpoint.strict", "checkpoints always load strictly here (a missing or "
             "extra tensor is an error)"),
    VerlRule("actor_rollout_ref.actor.use_fused_kernels", "follows actor_rollout_ref.model.use_fused_kernels"),
    VerlRule("actor_rollout_ref.actor.freeze_vision_tower", "a vision-language setting; text models have no vision "
             "tower (vision data is refused at start-up)"),
    VerlRule("*.optim.zero_indexed_step", "posttrain's schedules count from step 0, verl's default",
             accepts=(True, None), instead="set it True"),
    # Hydra's choice of verl's training engine (``model_engine=megatron`` in a launch script)
    VerlRule("model_engine", "picks verl's training engine; posttrain trains with FSDP2 (verl's dp engine) and has "
             "no Megatron-LM, VeOmni or TorchTitan engine", accepts=("dp", "fsdp", None), instead="set it to dp"),
    VerlRule("*.model_engine", "picks verl's training engine; posttrain trains with FSDP2 (verl's dp engine)",
             accepts=("dp", "fsdp", None), instead="set it to dp"),
    # the settings sections of the other engines (their strategy value is refused, naming the engine)
    VerlRule("*.megatron.*", "settings of verl's Megatron-LM engine (strategy=megatron is refused)"),
    VerlRule("*.veomni.*", "settings of verl's VeOmni engine (strategy=veomni is refused)"),
    VerlRule("*.torchtitan.*", "settings of verl's TorchTitan engine (strategy=torchtitan is refused)"),
    VerlRule("*.automodel.*", "settings of verl's NeMo AutoModel engine (strategy=automodel is refused)"),
    # rollout: GPU serving-engine knobs
    VerlRule("actor_rollout_ref.rollout.cudagraph_capture_sizes", _GPU_ENGINE),
    VerlRule("actor_rollout_ref.rollout.data_parallel_size", _GPU_ENGINE),
    VerlRule("actor_rollout_ref.rollout.expert_parallel_size", _GPU_ENGINE),
    VerlRule("actor_rollout_ref.rollout.pipeline_model_parallel_size", _GPU_ENGINE),
    VerlRule("actor_rollout_ref.rollout.scheduling_policy", _GPU_ENGINE),
    VerlRule("actor_rollout_ref.rollout.multi_stage_wake_up", _GPU_ENGINE),
    VerlRule("actor_rollout_ref.rollout.skip_tokenizer_init", _GPU_ENGINE),
    VerlRule("actor_rollout_ref.rollout.full_determinism", "a CPU run is bit-reproducible from trainer.seed already"),
    VerlRule("actor_rollout_ref.rollout.seed", "sampling seeds follow trainer.seed (and rollout.seed_per_batch)"),
    VerlRule("actor_rollout_ref.rollout.engine_kwargs.trtllm", "TensorRT-LLM's engine arguments "
             "(rollout.name=trtllm is refused)"),
    VerlRule("actor_rollout_ref.rollout.router_config_path", "verl's multi-server request router; posttrain's "
             "engines run in the trainer's processes"),
    VerlRule("actor_rollout_ref.rollout.checkpoint_engine.*", "verl's weight-update engine; posttrain pushes "
             "weights itself (in process, or posttrain.distributed.weight_sync between processes)"),
    VerlRule("actor_rollout_ref.rollout.trace.*", "rollout tracing to weave/mlflow; posttrain writes samples with "
             "trainer.rollout_data_dir"),
    VerlRule("actor_rollout_ref.rollout.prometheus.enable", "verl's Prometheus exporter of the rollout servers",
             accepts=_OFF, instead="set it False (metrics.jsonl and `posttrain view` show the run)"),
    VerlRule("actor_rollout_ref.rollout.prometheus.*", "settings of verl's Prometheus exporter"),
    VerlRule("actor_rollout_ref.rollout.enable_rollout_routing_replay", "MoE router replay needs Megatron's MoE "
             "engine", accepts=_OFF, instead="set it False"),
    VerlRule("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", "an MoE serving metric of verl's servers"),
    VerlRule("actor_rollout_ref.rollout.quantization", "quantized rollouts (FP8 and the like) need vLLM on a GPU",
             accepts=_OFF, instead="set it null"),
    VerlRule("actor_rollout_ref.rollout.quantization_config_file", "quantized rollouts need vLLM on a GPU",
             accepts=_OFF, instead="set it null"),
    VerlRule("actor_rollout_ref.rollout.mtp", "speculative decoding with MTP heads needs verl's GPU engines",
             accepts=_OFF, instead="set it null"),
    VerlRule("actor_rollout_ref.rollout.qat", "quantization-aware rollouts need verl's QAT engine",
             accepts=_OFF, instead="set it null"),
    VerlRule("actor_rollout_ref.rollout.disaggregation.enabled", "prefill/decode disaggregation needs SGLang on GPUs",
             accepts=_OFF, instead="set it False"),
    VerlRule("*.disaggregation.*", "settings of SGLang's prefill/decode disaggregation"),
    VerlRule("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", "verl's interaction repeat count; each "
             "prompt's n samples are rollout.n here"),
    VerlRule("actor_rollout_ref.rollout.agent.custom_async_server.path", "verl's custom async rollout server; "
             "posttrain's engines are hf and vllm", accepts=_OFF, instead="set it null"),
    VerlRule("actor_rollout_ref.rollout.agent.custom_async_server.name", "verl's custom async rollout server"),
    # model keys for back-ends posttrain does not have
    VerlRule("*.model.hf_config_path", "the model's config is read from model.path",
             accepts=_OFF, instead="set it null (the config is read from model.path)"),
    VerlRule("*.model.fused_kernel_options.*", "verl's fused-kernel back-end choice; posttrain's log-prob head is "
             "its own"),
    VerlRule("*.model.tiled_mlp.enabled", "tiled MLP (a long-sequence GPU memory trick) is not in posttrain",
             accepts=_OFF, instead="set it False"),
    VerlRule("*.model.tiled_mlp.*", "settings of tiled MLP, which posttrain does not have"),
    VerlRule("*.model.mtp.enable", "multi-token prediction training needs verl's Megatron engine",
             accepts=_OFF, instead="set it False"),
    VerlRule("*.model.mtp.enable_train", "multi-token prediction needs verl's Megatron engine",
             accepts=_OFF, instead="set it False"),
    VerlRule("*.model.mtp.enable_rollout", "MTP speculative decoding needs verl's GPU engines",
             accepts=_OFF, instead="set it False"),
    VerlRule("*.model.mtp.*", "settings of multi-token prediction, which posttrain does not have"),
    VerlRule("*.model.lora.merge", "with FSDP, posttrain's rollout reads the adapter where it is (hf engine) or "
             "pushes merged weights (vllm engine); the choice is made per engine"),
    VerlRule("*.model.lora.rank", "verl's Megatron LoRA (model.lora.*); with FSDP, LoRA is model.lora_rank",
             accepts=(0, None), instead="set model.lora_rank (and lora_alpha, target_modules) instead"),
    VerlRule("*.model.lora.*", "settings of verl's Megatron LoRA (model.lora.*); FSDP LoRA is model.lora_rank, "
             "lora_alpha, target_modules, exclude_modules, lora_adapter_path"),
    VerlRule("critic.model.custom_chat_template", "the critic reads the actor's token ids; the template is "
             "actor_rollout_ref.model.custom_chat_template"),
    VerlRule("critic.model.exclude_modules", "the critic trains full weights here (no LoRA)",
             accepts=_OFF, instead="set it null"),
    VerlRule("critic.model.lora_adapter_path", "the critic trains full weights here (no LoRA)",
             accepts=_OFF, instead="set it null"),
    VerlRule("critic.model.use_liger", "Liger kernels are GPU kernels", accepts=_OFF, instead="set it False"),
    VerlRule("critic.model.use_fused_kernels", "the critic's value head is a plain forward"),
    VerlRule("actor_rollout_ref.model.tokenizer_path", "the tokenizer is data.tokenizer (null: the model's)",
             accepts=_OFF, instead="set data.tokenizer instead"),
    # reward-model server knobs of the legacy tree (the reward loop's own are fields)
    VerlRule("reward_model.num_workers", "the legacy place of reward.num_workers (set that)"),
    VerlRule("reward_model.rollout.*", "the reward model's server is configured under reward.reward_model.rollout.*"),
    # algorithm and trainer
    VerlRule("algorithm.filter_groups.max_inflight_gen_batches", "posttrain's dynamic sampling generates one batch "
             "at a time (max_num_gen_batches bounds them)"),
    VerlRule("trainer.checkpoint_callback_class", "a class called after each checkpoint is not supported yet",
             accepts=_OFF, instead="set it null"),
    VerlRule("trainer.v1.separate_async.hybrid_rollout.enable_switch", "lending idle trainer devices to generation "
             "needs verl's V1 separate_async engine", accepts=_OFF, instead="set it False"),
    VerlRule("trainer.v1.separate_async.hybrid_rollout.*", "settings of verl's hybrid-rollout switch, which "
             "posttrain does not have"),
    VerlRule("trainer.v1.colocate_async.num_warmup_batches", "posttrain's colocated async mode starts with one batch "
             "in flight (async_training.staleness_threshold)"),
    VerlRule("trainer.v1.separate_async.num_warmup_batches", "the rollout pool starts its in-flight budget at once "
             "(async_training.*)"),
    VerlRule("trainer.v1.sampler.max_off_policy_strategy", "samples beyond the staleness bound are dropped here "
             "(verl's drop)", accepts=("drop", None), instead="set it drop"),
    VerlRule("trainer.v1.sampler.sync_refill_failed_groups", "posttrain refills nothing: a failed group is an error "
             "or counted per reward.on_error"),
    VerlRule("trainer.v1.sampler.custom_sampler.path", "a custom replay-buffer sampler is not supported",
             accepts=_OFF, instead="set it null"),
    VerlRule("trainer.v1.sampler.custom_sampler.name", "a custom replay-buffer sampler is not supported"),
    VerlRule("trainer.v1.sampler.sampler_kwargs", "a custom replay-buffer sampler is not supported"),
    VerlRule("trainer.v1.sync", "the sync mode has no settings"),
)
"""verl 0.9.1 keys of the RL tree with no posttrain field, in matching order (the first match wins)."""

PPO_ALIASES: tuple[tuple[str, str], ...] = (
    ("critic.fsdp.", "critic.model.fsdp_config."),
    ("sandbox_fusion.", "reward.sandbox_fusion."),
    ("reward_model.enable_resource_pool", "reward.reward_model.enable_resource_pool"),
    ("reward_model.n_gpus_per_node", "reward.reward_model.n_gpus_per_node"),
    ("reward_model.nnodes", "reward.reward_model.nnodes"),
    ("reward_model.reward_loop_source", "reward.reward_manager.source"),
    ("reward_model.reward_loop_module_path", "reward.reward_manager.module.path"),
    ("reward_model.reward_loop_class_name", "reward.reward_manager.module.name"),
    ("reward.timeout", "reward.timeout_s"),  # verl's limit manager reads +reward.timeout (seconds a row may take)
    # verl's SAPO scripts write these under policy_loss, where verl 0.9.1 ignores them (it reads actor.tau_pos);
    # posttrain honours what the script means
    ("actor_rollout_ref.actor.policy_loss.tau_pos", "actor_rollout_ref.actor.tau_pos"),
    ("actor_rollout_ref.actor.policy_loss.tau_neg", "actor_rollout_ref.actor.tau_neg"),
    ("rollout.nnodes", "actor_rollout_ref.rollout.nnodes"),
    ("rollout.n_gpus_per_node", "actor_rollout_ref.rollout.n_gpus_per_node"),
    ("rollout.total_rollout_steps", "actor_rollout_ref.rollout.total_rollout_steps"),
)
"""(verl 0.9 prefix, posttrain prefix): the same setting under posttrain's name. ``rollout.nnodes`` and
``rollout.n_gpus_per_node`` are where verl's one-step-off and fully-async configs size the rollout pool."""

SFT_ALIASES: tuple[tuple[str, str], ...] = ()
SFT_NO_EFFECT: tuple[VerlRule, ...] = ()


def _matches(key: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(key, pattern)


def rule_for(key: str, rules: tuple[VerlRule, ...] = NO_EFFECT) -> Optional[VerlRule]:
    """The first rule whose pattern matches ``key``, or None."""
    for rule in rules:
        if _matches(key, rule.pattern):
            return rule
    return None


def alias_of(key: str, known: Any, aliases: tuple[tuple[str, str], ...] = PPO_ALIASES) -> Optional[str]:
    """posttrain's key for verl's ``key`` when an alias maps it onto a key in ``known``, else None."""
    for verl_prefix, ours in aliases:
        if key == verl_prefix or (verl_prefix.endswith(".") and key.startswith(verl_prefix)):
            candidate = ours + key[len(verl_prefix):]
            if candidate != key:
                return candidate
    return None


def no_effect_lines(items: list[str], rules: tuple[VerlRule, ...] = NO_EFFECT) -> list[str]:
    """One line per reason for the ``key=value`` items a config keeps in ``no_effect``:
    ``no effect here: a.b, c.d (why)``."""
    by_reason: dict[str, list[str]] = {}
    for item in items:
        key = item.split("=", 1)[0]
        rule = rule_for(key, rules)
        by_reason.setdefault(rule.reason if rule else "not used by posttrain", []).append(key)
    return [f"no effect here: {', '.join(keys)} ({reason})" for reason, keys in by_reason.items()]


_FSDP_INSTEAD = "posttrain trains with FSDP2 (one process on a CPU, or Ray/torchrun ranks): set it to fsdp"
BACKENDS: dict[str, dict[str, tuple[str, str]]] = {
    "strategy": {
        "megatron": ("verl's Megatron-LM engine (tensor, pipeline and expert parallelism)", _FSDP_INSTEAD),
        "fsdp_turbo": ("verl's fsdp_turbo engine", _FSDP_INSTEAD),
        "veomni": ("verl's VeOmni engine", _FSDP_INSTEAD),
        "torchtitan": ("verl's TorchTitan engine", _FSDP_INSTEAD),
        "automodel": ("verl's NeMo AutoModel engine", _FSDP_INSTEAD),
    },
    "name": {
        "sglang": ("SGLang, which posttrain's rollout does not drive yet", "set actor_rollout_ref.rollout.name=vllm or hf"),
        "trtllm": ("TensorRT-LLM (NVIDIA GPUs)", "set actor_rollout_ref.rollout.name=vllm or hf"),
    },
    "device": {
        "npu": ("Ascend NPUs (torch_npu)", "set trainer.device=auto (CUDA where present, else the CPU)"),
    },
}
"""verl values of a key (by its last part) that name a back-end posttrain lacks: (what it needs, what to do)."""


def backend_refusal(key: str, value: Any) -> Optional[str]:
    """One line for a value that names a back-end posttrain does not have, or None."""
    found = BACKENDS.get(key.rsplit(".", 1)[-1], {}).get(str(value))
    if found is None:
        return None
    needs, instead = found
    return f"{key}={value}: needs {needs}; {instead}"


KEY_LISTS = {"ppo_trainer": "verl/trainer/config/_generated_ppo_trainer.yaml",
             "sft_trainer_engine": "verl/trainer/config/sft_trainer_engine.yaml with its defaults (hf_model, fsdp)"}
"""The recorded key lists (``posttrain/config/verl_0_9_1/<name>_keys.txt``: the leaf keys of verl 0.9.1's file)."""


def verl_key_names(name: str) -> list[str]:
    """verl 0.9.1's leaf keys of one config tree (`KEY_LISTS`), in verl's order."""
    return (Path(__file__).parent / "verl_0_9_1" / f"{name}_keys.txt").read_text().split()
