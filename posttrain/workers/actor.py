"""The actor (policy being trained) and the reference policy (frozen, loaded from the same weights).

Shapes: ``N`` responses in the batch, ``R`` response length, ``P + R`` full sequence length.

``ActorWorker.update_policy`` is verl's ``DataParallelPPOActor.update_policy``:
``ppo_epochs`` x mini-batches of ``ppo_mini_batch_size`` responses (one optimizer step each) x
micro-batches of ``ppo_micro_batch_size_per_gpu`` (or ``ppo_max_token_len_per_gpu`` tokens with
``use_dynamic_bsz``), with mini-batch-normalised gradient accumulation (see ``common.py``).
Batch sizes arrive normalised (responses per rank), as in verl's workers.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.algorithms import agg_loss, get_policy_loss_fn, kl_penalty, masked_mean
from posttrain.host.allocator import mapped_allocations, release_freed_memory
from posttrain.checkpoint.ranks import process_rank
from posttrain.checkpoint.role import load_role_into, save_role
from posttrain.models import autocast_context, compute_response_logprobs, default_device, load_tokenizer, parse_dtype
from posttrain.models import response_logprobs
from posttrain.models.compile import enable_layer_compile
from posttrain.models.lora import LoraAdapter, merged_for_generation
from posttrain.host.paging import offload_directory, one_pass, page_module
from posttrain.rollout import SamplingParams, get_rollout_engine
from posttrain.workers.common import ConfigWithBatchInfo, MetricMeter, response_mask_of
from posttrain.workers.optim import PagedAdamW, build_lr_scheduler, build_optimizer, trainable_parameters
from posttrain.workers.prepare import InProcess, decide_param_dtype, load_role_model, prepare
from posttrain.workers.update import ppo_update

__all__ = ["ActorWorker", "LoraReference", "RefWorker"]

_LOGPROB_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


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
            is None, ``auto`` precision decided, moved to ``device``. With LoRA only the adapters
            train (the optimizer holds nothing else) and `compute_ref_log_prob` is the reference policy.
    """

    def __init__(self, model_config: Any, actor_config: Any, rollout_config: Any = None, *,
                 device: str | torch.device | None = None, module: nn.Module | None = None,
                 tokenizer: Any = None, seed: int = 0, lora: LoraAdapter | None = None,
                 param_dtype: str | None = None):
        self.config, self.rollout_config = actor_config, rollout_config
        self.device = torch.device(device) if device is not None else default_device()
        if param_dtype is None:
            ready = prepare("policy", model_config, actor_config.fsdp_config, InProcess(self.device),
                            section="actor_rollout_ref.model", module=module, lora=lora, seed=seed)
            module, lora, param_dtype = ready.module, ready.lora, ready.param_dtype
        self.lora, self.module, self.param_dtype = lora, module, param_dtype
        if model_config is not None and model_config.compile_layers:
            enable_layer_compile(self.module)
        if tokenizer is None and model_config is not None:
            tokenizer = load_tokenizer(model_config.path, trust_remote_code=model_config.trust_remote_code,
                                       custom_chat_template=model_config.custom_chat_template)
        self.tokenizer = tokenizer
        self.autocast = functools.partial(autocast_context, self.device, self.param_dtype)
        # frozen parameters (a LoRA base) stay out of the optimizer: no state, no weight decay
        paged = offload_directory(actor_config.fsdp_config, "optimizer_offload", "actor_rollout_ref.actor",
                                  self.module, self.device)
        self.optimizer = build_optimizer(trainable_parameters(self.module), actor_config.optim, paged)
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
        engine = self.multi_turn_rollout() if self.rollout_config.multi_turn.enable else self.rollout
        with self._generation_weights(), self._memory_first():
            return engine.generate(prompts, sampling)

    def multi_turn_rollout(self) -> Any:
        """The agent loop over this actor's engine (``multi_turn.enable``), built on first use with the
        YAML-configured tools plus ``self.extra_tools`` (the Python API's ``trainer.tools``)."""
        if getattr(self, "_multi_turn", None) is None:
            from posttrain.rollout.multi_turn import MultiTurnRollout

            self._multi_turn = MultiTurnRollout.from_config(self.rollout, self.tokenizer, self.rollout_config,
                                                            getattr(self, "extra_tools", ()))
        return self._multi_turn

    @contextlib.contextmanager
    def _memory_first(self):
        """With ``optimizer_offload`` on a CPU run (memory chosen over speed, `posttrain.host.paging`) the phase's
        large buffers get mappings of their own, unmapped when freed, and what the heap freed goes back to
        the kernel after it (`posttrain.host.allocator`): otherwise freed memory stays for the next phase to
        reuse, and the holes between longer-lived tensors grow the heap from step to step. The built-in
        run at fp32 (bench_memory.py, micro-batches of 16) peaked at 4.1-4.2 GB without this and 3.1-3.2 GB
        with it (2.5-2.7 GB with micro-batches of 8); it costs ~x0.93 a step (fresh pages zero-filled)."""
        if not isinstance(self.optimizer, PagedAdamW):
            yield
            return
        with mapped_allocations():
            yield
        release_freed_memory()

    def _generation_weights(self) -> contextlib.AbstractContextManager:
        """LoRA with the ``hf`` engine (which decodes with the module itself): the adapters merged into
        the weights for the rollout (``models.lora.merged_for_generation``); otherwise nothing to do."""
        if self.lora is None or getattr(self.rollout, "keeps_own_weights", False):
            return contextlib.nullcontext()
        return merged_for_generation(self.module, parse_dtype(self.param_dtype))

    # ------------------------------------------------------------------ log-probs
    def compute_log_prob(self, batch: Any, calculate_entropy: bool = True):
        """(log_probs ``[N, R]``, entropy ``[N, R]`` or None) of ``batch['responses']``, no grad.

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

    # ------------------------------------------------------------------ update
    def _micro_step(self, mb: dict, info: dict, meter: MetricMeter, *, temperature: float) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns its (mini-batch-normalised) loss."""
        cfg = self.config
        mode, mask = cfg.loss_agg_mode, response_mask_of(mb)
        with self.autocast():
            log_prob, entropy = response_logprobs(
                self.module, *(mb[k] for k in _LOGPROB_KEYS), temperature=temperature,
                calculate_entropy=True, entropy_grad=cfg.entropy_coeff != 0,
                remove_padding=bool(cfg.use_remove_padding), shared_prefix=bool(cfg.use_prefix_grouper))
        pg_loss, pg_metrics = self.policy_loss_fn(
            old_log_prob=mb["old_log_probs"] if "old_log_probs" in mb else log_prob.detach(), log_prob=log_prob, advantages=mb["advantages"],
            response_mask=mask, loss_agg_mode=mode, config=ConfigWithBatchInfo(cfg, info),
            rollout_is_weights=mb.get("rollout_is_weights"))
        entropy_agg = agg_loss(entropy, mask, mode, **info)
        loss = pg_loss - cfg.entropy_coeff * entropy_agg if cfg.entropy_coeff != 0 else pg_loss
        if cfg.use_kl_loss:
            kl = agg_loss(kl_penalty(log_prob, mb["ref_log_prob"], cfg.kl_loss_type), mask, mode, **info)
            loss = loss + cfg.kl_loss_coef * kl
            meter.add("actor/kl_loss", kl)
        loss.backward()
        share = float(mask.sum()) / max(info["batch_num_tokens"], 1.0)  # token share of the mini-batch
        meter.add("actor/pg_loss", pg_loss)
        meter.add("actor/entropy", entropy_agg)
        if "old_log_probs" not in mb and "rollout_log_probs" in mb:  # on-policy: no separate pass measured the gap
            gap = (mb["rollout_log_probs"].exp() - log_prob.detach().float().exp()).abs()
            meter.add("training/rollout_actor_probs_diff_mean", masked_mean(gap, mask.float()), share)
        for name, value in pg_metrics.items():
            meter.add(name, value, share)
        return loss.detach()

    def update_policy(self, batch: Any) -> dict[str, float]:
        """PPO epochs over ``batch``; returns verl-named metrics averaged over mini-batches.

        Needs ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``, ``old_log_probs``,
        ``advantages`` (``[N, R]`` / ``[N, P+R]``), ``ref_log_prob`` when ``use_kl_loss``, and optionally
        ``response_mask`` (default: the response part of ``attention_mask``) and ``rollout_is_weights``
        (multiplies the per-token policy loss). The lr schedule advances once per call.

        On-policy updates (``ppo_epochs == 1`` and the batch is one mini-batch) may omit
        ``old_log_probs``: the policy has not moved since the rollout, so the update's own log-probs,
        detached, are the old ones (verl's ``on_policy`` branch), saving the separate forward of
        ``compute_log_prob``.
        """
        cfg = self.config
        on_policy = cfg.ppo_epochs == 1 and len(batch["responses"]) <= cfg.ppo_mini_batch_size
        if "old_log_probs" not in batch and not on_policy:
            raise KeyError(f"update_policy needs 'old_log_probs' unless the update is on-policy (ppo_epochs=1 and "
                           f"one mini-batch); got ppo_epochs={cfg.ppo_epochs}, {len(batch['responses'])} responses "
                           f"and ppo_mini_batch_size={cfg.ppo_mini_batch_size}")
        keys = [*_LOGPROB_KEYS, "advantages"] + (["old_log_probs"] if "old_log_probs" in batch else [])
        keys += ["ref_log_prob"] if cfg.use_kl_loss else []
        keys += [k for k in ("response_mask", "rollout_is_weights") if k in batch]
        keys += ["rollout_log_probs"] if "rollout_log_probs" in batch and "old_log_probs" not in batch else []
        data = {k: batch[k] for k in keys}
        data["response_mask"] = response_mask_of(data)
        temperature = _temperature(batch, self.rollout_config)
        step = functools.partial(self._micro_step, temperature=temperature)
        with self._memory_first():
            metrics = ppo_update(data, cfg, micro_step=step, module=self.module, optimizer=self.optimizer,
                                 lr_scheduler=self.lr_scheduler, generator=self.generator, device=self.device,
                                 prefix="actor", shared_prefix=bool(cfg.use_prefix_grouper))
        self.weights_version += 1
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        return metrics

    # ------------------------------------------------------------------ SFT / DPO (posttrain.workers.sft)
    def update_sft(self, batch: Any) -> dict[str, float]:
        """One optimizer step of token-mean NLL on ``response_mask`` tokens (`posttrain.workers.sft`)."""
        from posttrain.workers.sft import sft_update

        return sft_update(self, batch)

    def compute_sft_loss(self, batch: Any) -> torch.Tensor:
        """``[N, 2]``: NLL summed over each row's trained tokens, and their count; no grad."""
        from posttrain.workers.sft import sft_loss_sums

        return sft_loss_sums(self, batch)

    def compute_sequence_logps(self, batch: Any, reference: bool = False) -> torch.Tensor:
        """``[N, 2]``: summed log-prob of each row's ``response_mask`` tokens and their count; with
        ``reference`` (LoRA only) under the base model, the adapters disabled."""
        from posttrain.workers.sft import actor_sequence_logps

        if not reference:
            return actor_sequence_logps(self, batch)
        if self.lora is None:
            raise RuntimeError("the actor is its own reference only with LoRA (adapters disabled)")
        with self.lora.disabled():
            return actor_sequence_logps(self, batch)

    def update_dpo(self, batch: Any, beta: float, loss_type: str, label_smoothing: float) -> dict[str, float]:
        """One optimizer step of the DPO loss on chosen/rejected row pairs (`posttrain.workers.sft`)."""
        from posttrain.workers.sft import dpo_update

        return dpo_update(self, batch, beta, loss_type, label_smoothing)

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
        module: the reference model (frozen here: eval mode, ``requires_grad=False``).
        ref_config: ``actor_rollout_ref.ref`` (log-prob micro-batches, fsdp_config precision).
        rollout_config: for the temperature when ``meta_info`` lacks one.
        remove_padding: padding-free forward (``actor_rollout_ref.model.use_remove_padding``).
    """

    def __init__(self, module: nn.Module, ref_config: Any, rollout_config: Any = None, *,
                 device: str | torch.device | None = None, remove_padding: bool = False,
                 param_dtype: str | None = None, compile_layers: bool = False):
        self.config, self.rollout_config = ref_config, rollout_config
        self.remove_padding = remove_padding
        self.device = torch.device(device) if device is not None else default_device()
        module = module.to(self.device)
        # the actor's precision when given (log-probs comparable with the old ones), else the config's
        self.param_dtype = param_dtype or decide_param_dtype(ref_config.fsdp_config.mixed_precision.param_dtype,
                                                             module, self.device)
        self.module = module.eval().requires_grad_(False)
        # param_offload on a CPU run: the weights in a file, paged out after each pass (posttrain.host.paging)
        directory = offload_directory(ref_config.fsdp_config, "param_offload", "actor_rollout_ref.ref", module,
                                      self.device)
        self.paged = page_module(self.module, directory) if directory is not None else None
        if compile_layers:
            enable_layer_compile(self.module)
        self.autocast = functools.partial(autocast_context, self.device, self.param_dtype)

    @classmethod
    def from_config(cls, model_config: Any, ref_config: Any, rollout_config: Any = None, *,
                    device: str | torch.device | None = None, param_dtype: str | None = None) -> "RefWorker":
        """Load ``model_config.path`` (no gradient checkpointing: the reference never trains)."""
        dev = torch.device(device) if device is not None else default_device()
        module = load_role_model("policy", model_config, ref_config.fsdp_config.model_dtype)
        return cls(module, ref_config, rollout_config, device=dev, remove_padding=bool(model_config.use_remove_padding),
                   param_dtype=param_dtype, compile_layers=bool(model_config.compile_layers))

    def compute_ref_log_prob(self, batch: Any) -> torch.Tensor:
        """``ref_log_prob`` ``[N, R]`` of ``batch['responses']``."""
        cfg = self.config
        with one_pass(self.paged):
            log_probs, _ = compute_response_logprobs(
                self.module, batch, cfg.log_prob_micro_batch_size_per_gpu, _temperature(batch, self.rollout_config),
                False, use_dynamic_bsz=bool(cfg.log_prob_use_dynamic_bsz),
                max_token_len=cfg.log_prob_max_token_len_per_gpu, autocast=self.autocast,
                remove_padding=self.remove_padding, shared_prefix=bool(cfg.use_prefix_grouper),
            )
        return log_probs


    def compute_sequence_logps(self, batch: Any) -> torch.Tensor:
        """``[N, 2]``: summed log-prob of each row's ``response_mask`` tokens under the reference, and their count."""
        from posttrain.workers.sft import sequence_logps

        with one_pass(self.paged):
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
