"""The critic: a value model trained on GAE returns with the clipped value loss (verl's dp_critic).

Values are read from the hidden state *before* each response token: ``values[:, j]`` comes from
column ``P - 1 + j``, the state that predicts response token ``j`` (verl slices
``[:, -R-1:-1]``), and is zeroed outside ``response_mask``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from posttrain.algorithms import compute_value_loss, masked_mean
from posttrain.algorithms.losses import with_loss_scale_factor
from posttrain.algorithms.batch_info import token_normalisers
from posttrain.algorithms.objectives import StepMetricNames, ppo_loop
from posttrain.checkpoint.role import load_role_into, save_role
from posttrain.models import ValueModel, autocast_context, default_device, response_hidden_states
from posttrain.models.compile import compiled_layers
from posttrain.models.lora import LoraAdapter
from posttrain.models.microbatch import equal_micro_batch_count, forward_micro_batches
from posttrain.models.shared_prefix import prompt_key
from posttrain.models.microbatch import select_rows
from posttrain.workers.common import MetricMeter, response_mask_of
from posttrain.optim.build import build_lr_scheduler
from posttrain.workers.prepare import OnDevice, Placement, prepare
from posttrain.workers.update import run_update

__all__ = ["CriticWorker", "response_values"]

_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
_STEP_METRICS = StepMetricNames("critic/grad_norm", "critic/nonfinite_skipped", "critic/lr")


def response_values(model: ValueModel, input_ids, attention_mask, position_ids, responses,
                    remove_padding: bool = False, shared_prefix: bool = False) -> torch.Tensor:
    """One micro-batch: values ``[B, R]`` float32 (0 outside the response mask); differentiable.
    ``shared_prefix``: each distinct prompt (and the beginning the prompts share) encoded once."""
    resp_len = responses.shape[1]
    with compiled_layers(model):  # critic.model.compile_layers=True: the decoder layers through torch.compile
        hidden, take = response_hidden_states(model.backbone, input_ids, attention_mask, position_ids, resp_len,
                                              remove_padding, shared_prefix)
    values = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
    values = torch.cat([model.values_from_hidden(hidden), values[:, take:]], dim=1)
    return values * attention_mask[:, -resp_len:].to(values.dtype)


class CriticWorker:
    """Value model + AdamW + lr schedule.

    Args:
        config: the ``critic`` section (model.*, optim.*, ppo_mini_batch_size, ppo_micro_batch_size_per_gpu,
            forward_micro_batch_size_per_gpu, ppo_epochs, shuffle, cliprange_value, loss_agg_mode, grad_clip,
            use_dynamic_bsz, ppo_max_token_len_per_gpu, forward_max_token_len_per_gpu).
        device: defaults to cuda when present, else cpu.
        module: a :class:`ValueModel` to use instead of loading ``config.model.path``.
        seed: seeds the mini-batch shuffle generator (and the LoRA adapters drawn here).
        lora: LoRA adapters already injected into ``module.backbone``. The value head stays trainable
            beside them (verl's LoRA critic keeps its score head in peft's ``modules_to_save``).
        param_dtype: the compute precision `posttrain.workers.build` decided (the actor's, when the
            critic's is ``auto``); given, ``module`` is ready and used as it is. Without it the module
            is made ready here by the builder's own steps (`posttrain.workers.prepare.prepare`, in
            this process): loaded when None, LoRA added when ``critic.model.lora_rank > 0`` and
            ``lora`` is None, ``auto`` timed on the backbone, placed by ``placement``.
        placement: where the module lives and how it runs (`posttrain.workers.prepare.Placement`); it
            hands out the optimizer. Default: `OnDevice` (``device``, no machine levers).
    """

    def __init__(self, config: Any, *, device: str | torch.device | None = None,
                 module: ValueModel | None = None, seed: int = 0, param_dtype: str | None = None,
                 lora: LoraAdapter | None = None, placement: Placement | None = None):
        self.config = config
        self.device = torch.device(device) if device is not None else default_device()
        mcfg = config.model
        placement = OnDevice(self.device) if placement is None else placement
        if param_dtype is None:
            ready = prepare("value", mcfg, mcfg.fsdp_config, placement, section="critic.model",
                            module=module, lora=lora, seed=seed)
            module, lora, param_dtype = ready.module, ready.lora, ready.param_dtype
        self.lora, self.module, self.param_dtype = lora, module, param_dtype
        self.autocast = functools.partial(autocast_context, self.device, self.param_dtype)
        # LoRA: the adapters and the value head train
        self.optimizer = placement.optimizer(self.module, config.optim, mcfg.fsdp_config, "critic.model")
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.optim)
        self.generator = torch.Generator().manual_seed(seed)
        self.remove_padding = bool(mcfg.use_remove_padding)
        self.shared_prefix = bool(config.use_prefix_grouper) and not self.remove_padding  # two layouts: packing wins

    def compute_values(self, batch: Any) -> torch.Tensor:
        """``values`` ``[N, R]`` for ``batch``, no grad, in ``forward_micro_batch_size_per_gpu`` rows."""
        cfg = self.config
        data = {k: batch[k] for k in _KEYS}
        micro = cfg.forward_micro_batch_size_per_gpu or cfg.ppo_micro_batch_size_per_gpu
        prompts = (prompt_key(data["input_ids"], data["attention_mask"], data["responses"].shape[1])
                   if self.shared_prefix else None)  # rows of one prompt in one micro-batch
        groups = forward_micro_batches(data["attention_mask"], micro, bool(cfg.use_dynamic_bsz),
                                       cfg.forward_max_token_len_per_gpu, prompts)
        out = torch.zeros(data["responses"].shape, dtype=torch.float32, device=data["responses"].device)
        self.module.eval()
        for idx, stand_in in equal_micro_batch_count(groups):  # FSDP: as many forwards as the other ranks
            if not idx.numel():  # this rank has no rows at all: nothing to run a stand-in on
                continue
            with torch.no_grad(), self.autocast():
                vals = response_values(self.module, **select_rows(data, idx, self.device),
                                       remove_padding=self.remove_padding, shared_prefix=self.shared_prefix)
            if not stand_in:
                out[idx.to(out.device)] = vals.to(out.device)
        return out

    def _micro_step(self, mb: dict, info: dict, meter: MetricMeter) -> torch.Tensor:
        cfg = self.config
        mask = response_mask_of(mb)
        with self.autocast():
            vpreds = response_values(self.module, *(mb[k] for k in _KEYS), remove_padding=self.remove_padding,
                                     shared_prefix=self.shared_prefix)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds, mb["returns"], mb["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode,
            **with_loss_scale_factor(info, cfg))
        vf_loss.backward()
        share = float(mask.sum()) / max(info["batch_num_tokens"], 1.0)
        meter.add("critic/vf_loss", vf_loss)
        meter.add("critic/vf_clipfrac", vf_clipfrac, share)
        meter.add("critic/vpred_mean", masked_mean(vpreds.detach(), mask), share)
        return vf_loss.detach()

    def update_critic(self, batch: Any) -> dict[str, float]:
        """``critic.ppo_epochs`` x mini-batches x micro-batches on ``values``/``returns``; verl metrics.

        Needs ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``, ``response_mask``,
        ``values`` (old) and ``returns`` ``[N, R]``. The lr schedule advances once per call.
        """
        data = {k: batch[k] for k in (*_KEYS, "response_mask", "values", "returns")}
        loop = ppo_loop(self.config, shared_prefix=self.shared_prefix)
        return run_update(data, loop, micro_step=self._micro_step, normalisers=token_normalisers,
                          names=_STEP_METRICS, module=self.module, optimizer=self.optimizer,
                          lr_scheduler=self.lr_scheduler, generator=self.generator, device=self.device)

    def save_checkpoint(self, folder: str | Path) -> None:
        """Write this role's state (weights, optimizer, lr schedule, shuffle generator, HF config) into
        the new folder ``folder``; sharded models: every rank calls it (`posttrain.checkpoint.role.save_role`;
        with LoRA the adapters and value head alone, plus ``lora_base.json``)."""
        save_role(folder, self)

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore what `save_checkpoint` wrote, at this or another world size (never executes code)."""
        load_role_into(folder, self)
