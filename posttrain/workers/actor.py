"""The actor (policy being trained) and the reference policy (frozen, loaded from the same weights).

Shapes: ``N`` responses in the batch, ``R`` response length, ``P + R`` full sequence length.

``ActorWorker.train(batch, objective)`` is the one update of the actor for every objective (PPO,
SFT, DPO, SimPO: `posttrain.algorithms.objectives`), run by the one update engine
(`posttrain.workers.update.run_update`); ``update_policy`` is verl's name for ``train`` with PPO.
Batch sizes arrive normalised (responses per rank), as in verl's workers.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.agents.episode import agent_enabled
from posttrain.algorithms import get_policy_loss_fn
from posttrain.algorithms.objectives import LOGPROB_KEYS, PPO, Objective
from posttrain.checkpoint.ranks import process_rank
from posttrain.checkpoint.role import load_role_into, save_role
from posttrain.models import autocast_context, compute_response_logprobs, default_device, load_tokenizer, parse_dtype
from posttrain.models import response_logprobs
from posttrain.models.lean.into_grad import grads_into_params
from posttrain.models.lora import LoraAdapter, merged_for_generation
from posttrain.models.topk_logprobs import response_topk_logprobs
from posttrain.rollout import SamplingParams, get_rollout_engine
from posttrain.rollout.seeding import SEED_KEY, seeded_sampling
from posttrain.workers.common import MetricMeter, response_mask_of
from posttrain.optim.build import build_lr_scheduler
from posttrain.workers.prepare import OnDevice, Placement, decide_param_dtype, prepare
from posttrain.workers.update import run_update

__all__ = ["ActorWorker", "LoraReference", "RefWorker", "sequence_logps"]


def sequence_logps(module: nn.Module, batch: Any, *, micro_batch_size: int, autocast: Any,
                   remove_padding: bool = False, shared_prefix: bool = False) -> torch.Tensor:
    """``[N, 2]``: per row, the summed log-prob of its ``response_mask`` tokens under ``module`` and
    their count; no grad (the policy, the frozen reference, or the LoRA policy with adapters off)."""
    module.eval()
    log_probs, _ = compute_response_logprobs(module, batch, micro_batch_size, 1.0, False, autocast=autocast,
                                             remove_padding=remove_padding, shared_prefix=shared_prefix)
    mask = batch["response_mask"].to(log_probs.device, log_probs.dtype)
    return torch.stack([(log_probs * mask).sum(-1), mask.sum(-1)], dim=-1)


def _temperature(batch: Any, rollout_config: Any) -> float:
    """``meta_info['temperature']`` when the trainer set it, else ``rollout.temperature``."""
    meta = getattr(batch, "meta_info", {}) or {}
    temp = meta.get("temperature", getattr(rollout_config, "temperature", None))
    if temp is None:
        raise ValueError("no temperature: set batch.meta_info['temperature'] or pass a rollout config")
    return float(temp)


class ActorWorker:
    """Policy model + AdamW + lr schedule; log-probs, PPO-style updates and the hybrid rollout.

    Args:
        model_config: ``actor_rollout_ref.model`` (path, trust_remote_code, override_config,
            enable_gradient_checkpointing, custom_chat_template).
        actor_config: ``actor_rollout_ref.actor``.
        rollout_config: ``actor_rollout_ref.rollout`` (temperature, log-prob micro-batches, sampling).
        device: defaults to cuda when present, else cpu.
        module, tokenizer: use these instead of loading ``model_config.path`` (tests, sharing).
        seed: seeds the mini-batch shuffle generator (and the LoRA adapters drawn here).
        lora: the adapters already injected into ``module``.
        param_dtype: the compute precision `posttrain.workers.build` decided; given, ``module`` is
            ready (loaded, adapted, placed) and used as it is. Without it (a worker built directly,
            in tests and notebooks) ``module`` is made ready here by the builder's own steps
            (`posttrain.workers.prepare.prepare` in this process): loaded when None, LoRA added
            when ``model_config`` asks (``lora_rank > 0`` or ``lora_adapter_path``) and ``lora``
            is None, ``auto`` precision decided, placed by ``placement``. With LoRA only the adapters
            train (the optimizer holds nothing else) and `compute_ref_log_prob` is the reference policy.
        placement: where the module lives and how it runs (`posttrain.workers.prepare.Placement`); it
            hands out the optimizer. Default: `OnDevice` (``device``, no machine levers).
    """

    def __init__(self, model_config: Any, actor_config: Any, rollout_config: Any = None, *,
                 device: str | torch.device | None = None, module: nn.Module | None = None,
                 tokenizer: Any = None, seed: int = 0, lora: LoraAdapter | None = None,
                 param_dtype: str | None = None, placement: Placement | None = None):
        self.config, self.rollout_config = actor_config, rollout_config
        self.device = torch.device(device) if device is not None else default_device()
        placement = OnDevice(self.device) if placement is None else placement
        if param_dtype is None:
            ready = prepare("policy", model_config, actor_config.fsdp_config, placement,
                            section="actor_rollout_ref.model", module=module, lora=lora, seed=seed)
            module, lora, param_dtype = ready.module, ready.lora, ready.param_dtype
        self.lora, self.module, self.param_dtype = lora, module, param_dtype
        if tokenizer is None and model_config is not None:
            tokenizer = load_tokenizer(model_config.path, trust_remote_code=model_config.trust_remote_code,
                                       custom_chat_template=model_config.custom_chat_template)
        self.tokenizer = tokenizer
        self.autocast = functools.partial(autocast_context, self.device, self.param_dtype)
        self.optimizer = placement.optimizer(self.module, actor_config.optim, actor_config.fsdp_config,
                                             "actor_rollout_ref.actor")
        self.lr_scheduler = build_lr_scheduler(self.optimizer, actor_config.optim)
        self.policy_loss_fn = get_policy_loss_fn(actor_config.policy_loss.loss_mode)
        self.generator = torch.Generator().manual_seed(seed)
        self.weights_version = 0  # bumped whenever the module's weights change (update, checkpoint load)
        # hybrid engine: built now so a missing engine (vllm, ...) fails at start-up, not mid-run; each
        # rank's engine samples with its own seed
        rank = process_rank()
        self.rollout = None if rollout_config is None else get_rollout_engine(
            rollout_config.name, model=self.module, tokenizer=self.tokenizer, autocast=self.autocast,
            config=rollout_config, seed=seed + rank)
        self._merged = None  # the merged LoRA weights of a generation under way (`refresh_generation_weights`)

    def generate_sequences(self, prompts: Any, validate: bool = False) -> Any:
        """Responses for ``prompts`` with ``rollout.*`` (or ``rollout.val_kwargs.*``) sampling.

        An engine with its own copy of the weights (vllm) first receives the module's current
        weights, streamed one tensor at a time (FSDP2 shards gathered one parameter at a time, on
        every rank together), when they changed since its last push.
        """
        if getattr(self.rollout, "keeps_own_weights", False) and self.rollout.weights_version != self.weights_version:
            self.rollout.update_weights(self.module)
            self.rollout.weights_version = self.weights_version
        sampling = SamplingParams.from_rollout_config(self.rollout_config, validate=validate)
        engine = (self.agent_rollout() if agent_enabled(self.rollout_config)
                  else self.multi_turn_rollout() if self.rollout_config.multi_turn.enable else self.rollout)
        with self._generation_weights() as self._merged, seeded_sampling(prompts.meta_info):
            try:
                out = engine.generate(prompts, sampling)
            finally:
                self._merged = None
        out.meta_info.pop(SEED_KEY, None)  # the batch's own: rounds or units joined later each had theirs
        return out

    def multi_turn_rollout(self) -> Any:
        """The agent loop over this actor's engine (``multi_turn.enable``), built on first use with the
        YAML-configured tools plus ``self.extra_tools`` (the Python API's ``trainer.tools``)."""
        if getattr(self, "_multi_turn", None) is None:
            from posttrain.rollout.multi_turn import MultiTurnRollout

            self._multi_turn = MultiTurnRollout.from_config(self.rollout, self.tokenizer, self.rollout_config,
                                                            getattr(self, "extra_tools", ()))
        return self._multi_turn

    def agent_rollout(self) -> Any:
        """Agent programs through an OpenAI-compatible endpoint over this actor's engine
        (``rollout.agent.episode``, `posttrain.agents.rollout.AgentRollout`), built on first use."""
        if getattr(self, "_agent_rollout", None) is None:
            from posttrain.agents.rollout import AgentRollout

            self._agent_rollout = AgentRollout(self.rollout, self.tokenizer, self.rollout_config)
        return self._agent_rollout

    def refresh_generation_weights(self) -> None:
        """Weights were loaded into the module inside a generation (a partial rollout's push, between two
        decoding steps): the generation's merged LoRA weights follow them. Nothing to do without LoRA."""
        if self._merged is not None:
            self._merged.refresh()

    def _generation_weights(self) -> contextlib.AbstractContextManager:
        """LoRA with the ``hf`` engine (which decodes with the module itself): the adapters merged into
        the weights for the rollout (``models.lora.merged_for_generation``); otherwise nothing to do."""
        if self.lora is None or getattr(self.rollout, "keeps_own_weights", False):
            return contextlib.nullcontext()
        return merged_for_generation(self.module, parse_dtype(self.param_dtype))

    # ------------------------------------------------------------------ log-probs
    def compute_log_prob(self, batch: Any, calculate_entropy: bool = True, calculate_sum_pi_squared: bool = False):
        """(log_probs ``[N, R]``, entropy ``[N, R]`` or None) of ``batch['responses']``, no grad; with
        ``calculate_sum_pi_squared`` a third ``[N, R]``: each token's sum of pi^2 over the vocabulary
        (``actor.calculate_sum_pi_squared``, for optimal_token_baseline), from the same forward.

        Micro-batches: ``rollout.log_prob_micro_batch_size_per_gpu`` rows, or
        ``rollout.log_prob_max_token_len_per_gpu`` tokens with ``rollout.log_prob_use_dynamic_bsz``.
        """
        cfg = self.rollout_config
        self.module.eval()
        return compute_response_logprobs(
            self.module, batch, cfg.log_prob_micro_batch_size_per_gpu, _temperature(batch, cfg),
            calculate_entropy, use_dynamic_bsz=bool(cfg.log_prob_use_dynamic_bsz),
            max_token_len=cfg.log_prob_max_token_len_per_gpu, autocast=self.autocast,
            remove_padding=bool(self.config.use_remove_padding), shared_prefix=bool(self.config.use_prefix_grouper),
            calculate_sum_pi_squared=calculate_sum_pi_squared,
        )

    def compute_ref_log_prob(self, batch: Any, ref_config: Any) -> torch.Tensor:
        """``ref_log_prob`` ``[N, R]``: the LoRA actor with its adapters disabled is the frozen initial
        policy (verl's "ref in actor": no second model), in ``ref_config``'s micro-batches
        (``actor_rollout_ref.ref.log_prob_*``), no entropy (as verl's ref pass)."""
        if self.lora is None:
            raise RuntimeError("compute_ref_log_prob on the actor needs LoRA (lora_rank > 0); full fine-tuning "
                               "keeps a separate RefWorker")
        self.module.eval()
        with self.lora.disabled():
            log_probs, _ = compute_response_logprobs(
                self.module, batch, ref_config.log_prob_micro_batch_size_per_gpu,
                _temperature(batch, self.rollout_config), False,
                use_dynamic_bsz=bool(ref_config.log_prob_use_dynamic_bsz),
                max_token_len=ref_config.log_prob_max_token_len_per_gpu, autocast=self.autocast,
                remove_padding=bool(self.config.use_remove_padding),
                shared_prefix=bool(ref_config.use_prefix_grouper))
        return log_probs

    # ------------------------------------------------------------------ training and scoring
    def train(self, batch: Any, objective: Objective | None = None) -> dict[str, float]:
        """One call of the update engine (`posttrain.workers.update.run_update`) on ``batch`` for
        ``objective`` (default `PPO`: verl's actor update); returns its metrics. The objective names the
        columns it reads, its loop sizes and its loss (`posttrain.algorithms.objectives`); this worker
        runs the forward (per-token log-probs of ``responses``) and the backward."""
        objective = PPO() if objective is None else objective
        cfg = self.config
        data = {k: batch[k] for k in objective.columns(batch, cfg)}
        data["response_mask"] = response_mask_of(data)
        temperature = _temperature(batch, self.rollout_config) if objective.temperature_from_batch else 1.0
        entropy, entropy_grad = objective.entropy(cfg)

        ids_key = objective.gathered_ids()  # top-k distillation: the policy's log-probs at the teacher's tokens too

        def micro_step(mb: dict, info: dict, meter: MetricMeter) -> torch.Tensor:
            # the graph is built and used only by this backward: the head's and the embedding's weight
            # gradients may go straight into .grad (no second vocabulary-sized tensor per micro-batch)
            with grads_into_params():
                with self.autocast():
                    options = dict(temperature=temperature, calculate_entropy=entropy, entropy_grad=entropy_grad,
                                   remove_padding=bool(cfg.use_remove_padding),
                                   shared_prefix=bool(cfg.use_prefix_grouper))
                    if ids_key is None:
                        log_prob, ent = response_logprobs(self.module, *(mb[k] for k in LOGPROB_KEYS), **options)
                    else:
                        out = response_topk_logprobs(self.module, *(mb[k] for k in LOGPROB_KEYS), ids=mb[ids_key],
                                                     k=mb[ids_key].shape[-1], **options)
                        log_prob, ent = out.log_probs, out.entropy
                        mb["student_topk_log_probs"], mb["student_topk_ids"] = out.at_ids, out.topk_ids
                loss = objective.loss(log_prob, ent, mb, info, meter, cfg)
            loss.backward()
            return loss.detach()

        # residency (paged state, freed heap) comes from the group's placement around this call
        metrics = run_update(data, objective.loop(cfg, len(data["responses"])), micro_step=micro_step,
                             normalisers=objective.normalisers, names=objective.metric_names, module=self.module,
                             optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, generator=self.generator,
                             device=self.device)
        self.weights_version += 1
        objective.finish(metrics, cfg)
        return metrics

    def update_policy(self, batch: Any) -> dict[str, float]:
        """verl's ``DataParallelPPOActor.update_policy``: `train` with `PPO`. Needs ``responses``,
        ``input_ids``, ``attention_mask``, ``position_ids``, ``old_log_probs`` (unless on-policy),
        ``advantages``, ``ref_log_prob`` when ``use_kl_loss``, optionally ``response_mask`` and
        ``rollout_is_weights``."""
        return self.train(batch, PPO())

    def compute_sequence_logps(self, batch: Any, reference: bool = False) -> torch.Tensor:
        """``[N, 2]``: summed log-prob of each row's ``response_mask`` tokens and their count, no grad;
        with ``reference`` (LoRA only) under the base model, the adapters disabled."""
        cfg = self.config
        scoring = functools.partial(sequence_logps, self.module, batch, micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
                                    autocast=self.autocast, remove_padding=bool(cfg.use_remove_padding),
                                    shared_prefix=bool(cfg.use_prefix_grouper))
        if not reference:
            return scoring()
        if self.lora is None:
            raise RuntimeError("the actor is its own reference only with LoRA (adapters disabled)")
        with self.lora.disabled():
            return scoring()

    # ------------------------------------------------------------------ checkpoint state
    def save_checkpoint(self, folder: str | Path) -> None:
        """Write this role's state (weights, optimizer, lr schedule, shuffle generator, HF config and
        tokenizer for export) into the new folder ``folder``; sharded models: every rank calls it.
        With LoRA the weights are the adapters alone (the base reloads from ``model.path``), plus
        ``lora_adapter/`` (a peft folder) and ``lora_base.json`` (`posttrain.checkpoint.role.save_role`)."""
        save_role(folder, self, tokenizer=self.tokenizer, adapter_folder=True)

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore what `save_checkpoint` wrote, at this or another world size (never executes code).
        LoRA: refused when the adapters were trained on other base weights."""
        load_role_into(folder, self)
        self.weights_version += 1


class RefWorker:
    """Frozen reference policy: log-probs of responses under the initial weights.

    Args:
        module: the reference model, placed (`posttrain.workers.build` prepares it; a raw module is
            moved to ``device``), frozen here: eval mode, ``requires_grad=False``.
        ref_config: ``actor_rollout_ref.ref`` (log-prob micro-batches, fsdp_config precision).
        rollout_config: for the temperature when ``meta_info`` lacks one.
        remove_padding: padding-free forward (``actor_rollout_ref.model.use_remove_padding``).
    """

    def __init__(self, module: nn.Module, ref_config: Any, rollout_config: Any = None, *,
                 device: str | torch.device | None = None, remove_padding: bool = False,
                 param_dtype: str | None = None):
        self.config, self.rollout_config = ref_config, rollout_config
        self.remove_padding = remove_padding
        self.device = torch.device(device) if device is not None else default_device()
        module = module.to(self.device)
        # the actor's precision when given (log-probs comparable with the old ones), else the config's
        self.param_dtype = param_dtype or decide_param_dtype(ref_config.fsdp_config.mixed_precision.param_dtype,
                                                             module, self.device)
        self.module = module.eval().requires_grad_(False)
        self.autocast = functools.partial(autocast_context, self.device, self.param_dtype)

    def compute_ref_log_prob(self, batch: Any) -> torch.Tensor:
        """``ref_log_prob`` ``[N, R]`` of ``batch['responses']``."""
        cfg = self.config
        log_probs, _ = compute_response_logprobs(
            self.module, batch, cfg.log_prob_micro_batch_size_per_gpu, _temperature(batch, self.rollout_config),
            False, use_dynamic_bsz=bool(cfg.log_prob_use_dynamic_bsz),
            max_token_len=cfg.log_prob_max_token_len_per_gpu, autocast=self.autocast,
            remove_padding=self.remove_padding, shared_prefix=bool(cfg.use_prefix_grouper),
        )
        return log_probs

    def compute_sequence_logps(self, batch: Any) -> torch.Tensor:
        """``[N, 2]``: summed log-prob of each row's ``response_mask`` tokens under the reference, and their count."""
        return sequence_logps(self.module, batch, micro_batch_size=self.config.log_prob_micro_batch_size_per_gpu,
                              autocast=self.autocast, remove_padding=self.remove_padding,
                              shared_prefix=bool(self.config.use_prefix_grouper))


class LoraReference:
    """The reference policy of a LoRA actor: the actor's own module with its adapters disabled
    (verl's ``ref_in_actor``), so no second copy of the model is loaded. Same call as `RefWorker`.

    Args:
        actor: the `ActorWorker` (with ``lora``).
        ref_config: ``actor_rollout_ref.ref`` (log-prob micro-batch keys).
    """

    def __init__(self, actor: ActorWorker, ref_config: Any):
        if actor.lora is None:
            raise ValueError("LoraReference needs an actor with LoRA adapters")
        self.actor, self.config = actor, ref_config

    @property
    def module(self) -> nn.Module:
        """The actor's module (a sharded rank moves it on and off the device for this phase)."""
        return self.actor.module

    def compute_ref_log_prob(self, batch: Any) -> torch.Tensor:
        """``ref_log_prob`` ``[N, R]`` of ``batch['responses']`` under the base model."""
        return self.actor.compute_ref_log_prob(batch, self.config)

    def compute_sequence_logps(self, batch: Any) -> torch.Tensor:
        """``[N, 2]`` as `RefWorker.compute_sequence_logps`, under the base model."""
        return self.actor.compute_sequence_logps(batch, reference=True)
