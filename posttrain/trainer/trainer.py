"""The RL training loop. One step (`train_step`) reads top to bottom:

    prompts -> generate n -> reward (rule-based and/or reward model) -> old log-prob -> ref log-prob
            -> [teacher log-probs] -> values -> rollout correction -> advantages -> critic update
            -> actor update -> metrics

On-policy distillation (``distillation.enabled``, `posttrain.trainer.distill`): the teachers score the
sampled tokens, and the actor's update runs the `Distill` objective instead of plain PPO.

Rollout (`_rollout`): with `algorithm.filter_groups.enable` (DAPO) groups whose responses all score
the same are dropped and more prompts are generated until the batch is full. Old log-probs
(`DerivedSizes.old_log_probs_from`): recomputed by the actor; or, when the update is one epoch of
one mini-batch, taken from the update's own forward (the pass is skipped); or, with
`algorithm.rollout_correction.bypass_mode`, the engine's. The rollout correction weighs or rejects
tokens where engine and trainer differ.

The algorithm is chosen by config alone (`algorithm.adv_estimator`, `actor.policy_loss.loss_mode`,
KL settings); `GRPOTrainer` and `PPOTrainer` are the same loop under the names users look for.
"""

from __future__ import annotations

import inspect
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from posttrain.agents.episode import check_agent_setup
from posttrain.agents.rollout import agent_scores, agent_step_metrics, old_log_probs_from
from posttrain.algorithms import (EstimatorsWith, apply_rollout_correction, get_adv_estimator_fn, get_kl_controller,
                                  kl_penalty, masked_mean)
from posttrain.batch import Batch
from posttrain.config import (ConfigError, PostTrainConfig, derive_sizes, describe_sizes, uses_critic,
                              validate_config, worker_config)
from posttrain.config.roles import rl_role_specs
from posttrain.checkpoint import CheckpointManager, capture_rng, restore_rng
from posttrain.distributed.host_phases import HostPhases
from posttrain.host.resident import PhasePeaks
from posttrain.rewards.manager import (ERRORS_KEY, RewardError, RewardInterrupted, RewardManager, numeric_columns,
                                       place_on_last_token)
from posttrain.rewards.rm_combine import combine_rm_scores, validation_skip_reason
from posttrain.rollout.multi_turn import multi_turn_columns, multi_turn_rewards
from posttrain.rollout.multi_turn_checks import check_multi_turn_setup
from posttrain.rollout.seeding import SEED_KEY, batch_seed
from posttrain.trainer import distill, preflight, resume, reward_loop, setup
from posttrain.trainer.dynamic_sampling import DynamicSampling, EpochsExhausted
from posttrain.trainer.metrics import StageTimer, compute_data_metrics, mean_entropy, rollout_actor_diff, throughput
from posttrain.trainer.rollout_dump import RolloutDumps
from posttrain.trainer.run import NonFiniteError, RunLoop, StepUndone  # NonFiniteError: importable here too
from posttrain.trainer.validation import run_validation
from posttrain.trainer.eval_card import write_validation_card

# Estimators whose baseline is the reward of a greedy response to the same prompt (ReMax): declared
# with their registration (`register_adv_est(..., needs_greedy_baseline=True)`), read live.
GREEDY_BASELINE_ESTIMATORS = EstimatorsWith("needs_greedy_baseline")


class RLTrainer:
    """PPO / GRPO / RLOO / REINFORCE++ / ReMax / ...: one process (CPU or one GPU), or one rank per
    device through Ray with FSDP2-sharded models (``trainer.nnodes x trainer.n_gpus_per_node``).

    Args:
        config: a loaded config (`posttrain.load_config`).
        actor_module, critic_module, tokenizer: use these instead of loading from the config's paths
            (tests build tiny random models this way).
        reward_fn: the reward function (any form the ``reward_fn`` setter takes) instead of the config's; given
            here, data whose data_source no built-in scorer knows is accepted before the models load.
    """

    metric_prefix = "training"  # the run loop logs training/epoch and training/global_step

    def __init__(self, config: PostTrainConfig, *, actor_module: Any = None, critic_module: Any = None,
                 tokenizer: Any = None, reward_fn: Callable | None = None):
        validate_config(config)
        setup.check_in_memory_models(config, actor_module, critic_module)
        setup.check_rollout_engine(config)
        self.config, self.sizes = config, derive_sizes(config)
        self.device = setup.resolve_device(config)
        # Everything that can be checked is checked before any model loads: paths, data files, the
        # checkpoint folder (writable, locked for this run, its rule), the custom reward function.
        preflight.preflight(config, actor_module, critic_module, tokenizer)
        tcfg = config.trainer
        self.checkpoints = CheckpointManager(Path(tcfg.default_local_dir).expanduser(), tcfg.max_actor_ckpt_to_keep,
                                             tcfg.max_critic_ckpt_to_keep)
        # the vocabulary is not known yet: the fingerprint's other keys say whose results the folder holds
        preflight.claim_checkpoint_folder(config, self.checkpoints, resume.config_fingerprint(config))
        seed_everything(config.trainer.seed)
        if tokenizer is None:
            from posttrain.models import load_tokenizer

            m = config.actor_rollout_ref.model
            try:
                tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code,
                                           custom_chat_template=m.custom_chat_template)
            except (OSError, ValueError) as err:  # not on the hub, offline and not cached, no tokenizer files
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ConfigError(f"actor_rollout_ref.model.path={m.path}: cannot load its tokenizer ({reason})") from err
        self.tokenizer = tokenizer
        self.data = setup.build_data(config, tokenizer)
        self.objective = distill.prepare(config, tokenizer, self.data)  # on-policy distillation's (None: PPO)
        check_multi_turn_setup(config, (self.data.train, self.data.val),
                               check_tool_names=bool(config.actor_rollout_ref.rollout.multi_turn.tool_config_path))
        check_agent_setup(config)  # rollout.agent.episode: the agent program loads (one line if not)
        self.reward_fn = reward_fn if reward_fn is not None else setup.build_reward_fn(config, tokenizer)
        preflight.check_data_sources(config, self.reward_fn, train=self.data.train, val=self.data.val)
        self.total_steps = self._total_steps()
        wcfg = worker_config(config, self.sizes)
        for optim in (wcfg.actor_rollout_ref.actor.optim, wcfg.critic.optim):
            if optim.total_training_steps < 0:
                optim.total_training_steps = self.total_steps
        preflight.check_lora_config(config, actor_module, critic_module)  # LoRA module names, before any weights load
        self.workers = setup.build_workers(config, rl_role_specs(wcfg), self.device, config.trainer.seed, actor_module,
                                           critic_module, tokenizer)
        # the machine's levers at phase boundaries (threads, freed memory): the placement's, not the trainer's
        self.host = HostPhases(adjust_threads=self.sizes.world_size == 1)
        self.host.after_loading()  # loading's transient copies (the dequantised GGUF) back to the kernel
        # trainer.rollout_data_dir / validation_data_dir: each step's samples on disk (posttrain view reads them)
        self.rollout_dumps = RolloutDumps.from_config(config, tokenizer, self.workers.writes)
        algo = config.algorithm
        self.kl_ctrl = get_kl_controller(algo.kl_ctrl) if algo.use_kl_in_reward else None
        self.adv_fn = get_adv_estimator_fn(algo.adv_estimator)
        self.use_critic = uses_critic(config)
        self.global_step = 0
        self.history: list[dict[str, float]] = []
        self.first_validation: dict[str, float] | None = None  # step 0's, this run's or the resumed one's
        self.stopped_by: int | None = None
        """The signal (SIGINT/SIGTERM) that stopped `fit` early, else None (the CLI exits 128 + it)."""
        self._nonfinite_streak = 0
        self.memory = PhasePeaks()  # this process's peak resident memory, per phase (posttrain.host.resident)

    # ------------------------------------------------------------------ reward function (Python API)
    @property
    def reward_fn(self) -> Callable[[Batch], tuple]:
        return self._reward_fn

    @reward_fn.setter
    def reward_fn(self, fn: Callable) -> None:
        """Accepts a reward manager, a per-row `compute_score(data_source, solution_str, ground_truth,
        extra_info=None)`, or a batch form `fn(batch) -> tensor[N]`."""
        from posttrain.rewards import BatchRewardFn, RewardManager

        if isinstance(fn, (RewardManager, BatchRewardFn, reward_loop.RewardLoop)):
            self._reward_fn = fn
        elif "solution_str" in inspect.signature(fn).parameters and reward_loop.takes_function(self, fn):
            self._reward_fn = reward_loop.with_function(self, fn)  # async, or the run's judge: the reward loop
        elif "solution_str" in inspect.signature(fn).parameters:
            self._reward_fn = RewardManager(self.tokenizer, compute_score=fn, reward_fn_key=self.config.data.reward_fn_key,
                                            on_error=self.config.reward.on_error, timeout_s=self.config.reward.timeout_s,
                                            **setup.dapo_reward_options(self.config))
        else:
            self._reward_fn = BatchRewardFn(fn)

    @property
    def tools(self) -> list:
        """Tools given through the Python API (multi-turn rollouts); the YAML ones are not listed."""
        return list(getattr(getattr(self.workers, "actor", None), "extra_tools", ()))

    @tools.setter
    def tools(self, tools: list) -> None:
        """Tools the model may call (``multi_turn.enable``): type-hinted functions with Google-style
        docstrings, or ``posttrain.tools.BaseTool`` objects, added to ``multi_turn.tool_config_path``'s."""
        from posttrain.tools import build_tools

        actor = getattr(self.workers, "actor", None)
        if not self.config.actor_rollout_ref.rollout.multi_turn.enable:
            raise ConfigError("trainer.tools needs actor_rollout_ref.rollout.multi_turn.enable=True")
        if actor is None:
            raise ConfigError("trainer.tools works in one process; on Ray ranks name the tools in "
                              "actor_rollout_ref.rollout.multi_turn.tool_config_path")
        actor.extra_tools = build_tools(tools)
        check_multi_turn_setup(self.config, (self.data.train, self.data.val), [t.name for t in actor.extra_tools])
        actor._multi_turn = None  # rebuilt with the new tools on the next rollout

    # ------------------------------------------------------------------ one step
    def train_step(self, prompts: Batch) -> dict[str, float]:
        cfg, w, timer, metrics = self.config, self.workers, StageTimer(self.memory, self.host.before_stage), {}
        correction = cfg.algorithm.rollout_correction
        entropy = None  # per token where the old log-probs are recomputed (written with the step's samples)
        with timer("step"):
            batch = self._rollout(prompts, timer, metrics)
            metrics.update(agent_step_metrics(batch))  # agent episodes: retokenized tokens, splits, failures
            old_from = old_log_probs_from(batch, self.sizes.old_log_probs_from)  # recompute, update (on-policy), rollout
            if old_from == "rollout":  # bypass_mode: the engine's log-probs, no recompute
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif old_from == "recompute":
                with timer("old_log_prob"):
                    if cfg.actor_rollout_ref.actor.calculate_sum_pi_squared:  # optimal_token_baseline reads it
                        batch["old_log_probs"], entropy, batch["sum_pi_squared"] = w.compute_log_prob(
                            batch, calculate_sum_pi_squared=True)
                    else:
                        batch["old_log_probs"], entropy = w.compute_log_prob(batch)
                    metrics.update(mean_entropy(entropy, batch["response_mask"]))
                    metrics.update(rollout_actor_diff(batch))
            if w.has_ref:
                with timer("ref"):
                    batch["ref_log_prob"] = w.compute_ref_log_prob(batch)
            if self.objective is not None:  # on-policy distillation: the teachers score the sampled tokens
                with timer("teacher"):
                    distill.score(w, batch)
            if self.use_critic:
                with timer("values"):
                    batch["values"] = w.compute_values(batch)
            if "rollout_log_probs" in batch.batch.keys() and old_from == "recompute":
                weights, batch["response_mask"], corr_metrics = apply_rollout_correction(
                    batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], correction)
                if weights is not None:
                    batch["rollout_is_weights"] = weights
                metrics.update(corr_metrics)
            with timer("adv"):
                batch["token_level_rewards"] = self._rewards_with_kl(batch, metrics)
                batch["advantages"], batch["returns"] = self.adv_fn(
                    token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
                    index=batch.non_tensor_batch["uid"], values=batch["values"] if self.use_critic else None,
                    reward_baselines=batch["reward_baselines"] if "reward_baselines" in batch else None,
                    gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                    norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo, config=cfg.algorithm,
                    **_estimator_inputs(batch))
            if self.use_critic:
                with timer("update_critic"):
                    metrics.update(w.update_critic(batch))
            if self.global_step > cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    metrics.update(w.update_actor(batch, self.objective))
        metrics.update(compute_data_metrics(batch, self.use_critic))
        metrics.update(timer.metrics() | w.memory_metrics())  # seconds and peak resident memory per phase
        metrics.update(throughput(batch, timer.seconds["step"], self.sizes.world_size))
        metrics.update({"training/global_step": self.global_step, "training/epoch": self.data.train_loader.epoch})
        self.last_batch = batch
        metrics.update(self.rollout_dumps.step(self.global_step, batch, self._reward_extra, entropy))
        return metrics

    def _rollout(self, prompts: Batch, timer: StageTimer, metrics: dict) -> Batch:
        """Generate n responses per prompt and score them. With algorithm.filter_groups.enable (DAPO's
        dynamic sampling) groups whose responses all score the same are dropped, and more prompt
        batches are drawn from the train loader until data.train_batch_size groups are kept."""
        fg = self.config.algorithm.filter_groups
        if not fg.enable:
            batch, extra = self._generate_and_score(prompts, timer)
        else:
            loader = self.data.train_loader
            sampling = DynamicSampling(fg.metric, self.config.data.train_batch_size,
                                       self.config.actor_rollout_ref.rollout.n, fg.max_num_gen_batches,
                                       self.data.train.pad_token_id, step=self.global_step,
                                       epoch_prompts=len(loader) * loader.sampler.batch_size)
            batch, extra, counts = sampling.collect(prompts, self._draw_prompts,
                                                    lambda p, first_uid: self._generate_and_score(p, timer, first_uid))
            metrics.update(counts)
        metrics.update(_extra_metrics(extra) | reward_loop.step_metrics(self.reward_fn))  # + judge counters
        self._reward_extra = extra  # the reward's per-response values, for the rollouts on disk
        return batch

    def _generate_and_score(self, prompts: Batch, timer: StageTimer, first_uid: int = 0) -> tuple[Batch, dict]:
        """One generation round: responses with their ``token_level_scores``, and the reward's extra output."""
        cfg, w = self.config, self.workers
        prompts.meta_info["temperature"] = cfg.actor_rollout_ref.rollout.temperature
        prompts.non_tensor_batch["uid"] = np.array(
            [f"s{self.global_step}-p{first_uid + i}" for i in range(len(prompts))], dtype=object)
        if cfg.actor_rollout_ref.rollout.seed_per_batch:
            prompts.meta_info[SEED_KEY] = batch_seed(cfg.trainer.seed, self.global_step, first_uid)
        with timer("gen"):
            batch = w.generate_sequences(prompts)
            if cfg.algorithm.adv_estimator in GREEDY_BASELINE_ESTIMATORS:
                batch["reward_baselines"] = self._greedy_baseline(prompts)
        with timer("reward"):
            batch["token_level_scores"], extra = self._score(batch)
            extra.update(multi_turn_columns(batch))
        return batch, extra

    def _draw_prompts(self) -> Batch:
        """The train loader's next prompt batch. When dynamic sampling (several batches a step) has used up
        trainer.total_epochs passes and trainer.total_training_steps is not set, the run ends instead,
        as verl's DAPO loop ends with its data loader."""
        loader = self.data.train_loader
        if (self.config.algorithm.filter_groups.enable and self.config.trainer.total_training_steps is None
                and loader.epoch >= self.config.trainer.total_epochs):
            raise EpochsExhausted
        return loader.next_batch()

    def _greedy_baseline(self, prompts: Batch) -> torch.Tensor:
        """ReMax: score of a greedy response per prompt, repeated for its n samples -> `[N]`."""
        greedy = self.workers.generate_sequences(prompts, validate=True)
        scores, _ = self._score(greedy)
        return scores.sum(-1).repeat_interleave(self.config.actor_rollout_ref.rollout.n)

    def _score(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """token_level_scores ``[N, R]`` and the reward's extra output: the reward model's score when
        reward_model.enable (replacing the reward function's, or added with reward_model.combine=sum,
        `posttrain.rewards.rm_combine.combine_rm_scores`), else the reward function's; plus the tools' and
        interactions' rewards with multi_turn.add_tool_rewards. Agent episodes: what each episode returned."""
        if (agent := agent_scores(batch)) is not None:
            return agent
        if self.workers.has_rm:
            rm_scores = self.workers.compute_rm_score(batch)  # the reward model's forward, on the workers
            scores, extra = combine_rm_scores(batch, rm_scores, self.reward_fn, self.config.reward_model.combine)
        else:
            scores, extra = self.reward_fn(batch)
        for key, values in reward_parts(extra, self.config.algorithm.gdpo_reward_keys).items():
            batch[key] = values  # gdpo's reward parts travel with their rows (verl: non_tensor_batch[key])
        tool_rewards = multi_turn_rewards(batch) if self.config.actor_rollout_ref.rollout.multi_turn.add_tool_rewards else None
        if tool_rewards is not None:  # tools' calc_reward + step rewards, interaction score
            scores = scores + place_on_last_token(tool_rewards.to(scores.device), batch["response_mask"].to(scores.device))
        return scores, extra

    def _rewards_with_kl(self, batch: Batch, metrics: dict) -> torch.Tensor:
        """token_level_scores - beta * KL(old || ref) when algorithm.use_kl_in_reward (verl's apply_kl_penalty)."""
        scores = batch["token_level_scores"]
        if self.kl_ctrl is None:
            return scores
        mask = batch["response_mask"].float()
        kld = kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], self.config.algorithm.kl_penalty) * mask
        beta = self.kl_ctrl.value
        current_kl = masked_mean(kld, mask, axis=-1).mean().item()
        self.kl_ctrl.update(current_kl=current_kl, n_steps=len(batch))
        metrics.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta})
        return scores - beta * kld

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        start = time.perf_counter()
        self.host.before_stage()
        n = self.config.actor_rollout_ref.rollout.val_kwargs.n
        batches = [b for b in _iterate_once(self.data.val_loader)]
        skipped = validation_skip_reason(self.config.reward_model.enable, batches)  # verl: rule-scored rows only
        if skipped:
            print(skipped, flush=True)
            return {}
        metrics, samples = run_validation(batches, lambda p: self.workers.generate_sequences(p, validate=True),
                                          lambda b: agent_scores(b) or self.reward_fn(b), n,
                                          self.config.data.reward_fn_key)
        metrics.update({f"val-aux/{k}": v for k, v in reward_loop.step_metrics(self.reward_fn).items()})  # judge calls
        self.rollout_dumps.validation(self.global_step, samples)
        metrics["timing_s/testing"] = time.perf_counter() - start
        write_validation_card(self.config, metrics, step=self.global_step, tokenizer=self.tokenizer,
                              workers=self.workers, prompts=sum(len(b) for b in batches))  # the conventions beside the numbers
        self.host.after_validation()
        return metrics

    # ------------------------------------------------------------------ the run (posttrain.trainer.run)
    def fit(self) -> list[dict[str, float]]:
        """Train until `total_steps`; returns the per-step metrics (also sent to `trainer.logger`).
        Signals, resume, validation and saving: `posttrain.trainer.run.RunLoop.fit`."""
        cfg = self.config.trainer
        print(describe_sizes(self.sizes), flush=True)
        print(self.host.describe(), flush=True)
        return RunLoop(self, validate_first=cfg.val_before_train or cfg.val_only, validate_only=cfg.val_only,
                       check=self._check_health, on_exit=self._close_reward_fn).fit()

    @property
    def train_loader(self) -> Any:
        return self.data.train_loader

    def step(self) -> dict[str, float]:
        """Draw the next prompts and train on them. A step that a signal during scoring, or the end of
        the data, interrupts had changed no weight yet: it is rolled back (`StepUndone`), so that a resume
        from the last saved step draws what it would have."""
        loader = self.data.train_loader
        before = (loader.state_dict(), capture_rng())
        self.workers.mark_step()  # each rank's own generators (the rollout draws from them)
        try:
            return self.train_step(self._draw_prompts())
        except (RewardInterrupted, EpochsExhausted) as stop:
            loader.load_state_dict(before[0])
            restore_rng(before[1])
            self.workers.rewind_step()
            if isinstance(stop, EpochsExhausted):
                print(f"dynamic sampling used up the {self.config.trainer.total_epochs} epochs of prompts "
                      f"(trainer.total_epochs) after step {self.global_step - 1}; the run ends there", flush=True)
            raise StepUndone(data_ended=isinstance(stop, EpochsExhausted)) from stop
        except RewardError as err:
            raise RewardError(f"step {self.global_step}: {err}") from err

    def _close_reward_fn(self, stopped: bool) -> None:
        if isinstance(self._reward_fn, (RewardManager, reward_loop.RewardLoop)):  # scorers and judge end with the run
            self._reward_fn.close(kill=stopped)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Each role writes its own state; the driver adds step, data position, KL controller, RNG."""
        run = resume.RunState(self.global_step, self._nonfinite_streak, self.first_validation)
        return resume.save_run(self.checkpoints, self.workers, run, self.data.train_loader, self.kl_ctrl,
                               self.fingerprint())

    def restore(self) -> resume.RunState | None:
        run = resume.restore_run(self.config.trainer, self.workers, self.data.train_loader,
                                 self.kl_ctrl, self.fingerprint())
        if run is not None:
            self._nonfinite_streak = run.nonfinite_streak
        return run

    def fingerprint(self) -> dict:
        """What a run resuming this one's checkpoints must share with it (`resume.config_fingerprint`)."""
        return resume.config_fingerprint(self.config, vocab_size=len(self.tokenizer))

    def _total_steps(self) -> int:
        if self.config.trainer.total_training_steps is not None:
            return self.config.trainer.total_training_steps
        return self.config.trainer.total_epochs * len(self.data.train_loader)

    def _check_health(self, metrics: dict[str, float]) -> None:
        """Skipped non-finite updates are counted by the workers; several steps in a row stop the run."""
        bad = metrics.get("actor/nonfinite_skipped", 0) + metrics.get("critic/nonfinite_skipped", 0)
        if bad == 0 and all(math.isfinite(v) for v in metrics.values()):
            self._nonfinite_streak, self._last_finite = 0, metrics
            return
        self._nonfinite_streak += 1
        limit = self.config.trainer.max_consecutive_nonfinite
        if self._nonfinite_streak >= limit:
            last = getattr(self, "_last_finite", {})
            shown = {k: round(v, 5) for k, v in last.items() if k.startswith(("actor/", "critic/score"))}
            raise NonFiniteError(
                f"step {self.global_step}: {self._nonfinite_streak} steps in a row had a non-finite loss or gradient "
                f"(limit trainer.max_consecutive_nonfinite={limit}); last finite metrics: {shown}. "
                "Lower actor_rollout_ref.actor.optim.lr, or check the reward function for inf/nan.")


# The names verl users look for. All are `RLTrainer`: the algorithm comes from the config, and the
# trainer runs its workers through Ray by itself when trainer.nnodes x trainer.n_gpus_per_node > 1.
GRPOTrainer = RLTrainer
PPOTrainer = RLTrainer
RayPPOTrainer = RLTrainer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _iterate_once(loader) -> list[Batch]:
    return list(iter(loader))


def _estimator_inputs(batch: Batch) -> dict[str, Any]:
    """What some estimators read beyond rewards, mask, groups and values (`posttrain.algorithms.advantages`):
    the per-row columns (gdpo's reward parts), the old log-probs with each token's sum of pi^2
    (optimal_token_baseline) where the step has them, and the rollout-correction weights."""
    inputs = {key: batch[key] for key in ("old_log_probs", "sum_pi_squared") if key in batch}
    weights = batch["rollout_is_weights"] if "rollout_is_weights" in batch else None
    return {"non_tensor_batch": batch.non_tensor_batch, "rollout_is_weights": weights, **inputs}


def reward_parts(extra: dict[str, np.ndarray], keys: Any) -> dict[str, np.ndarray]:
    """The reward parts named by ``keys`` (``algorithm.gdpo_reward_keys``) from the reward's extra output,
    one value per row. A row the scoring function failed on (``reward.on_error=zero``) scores 0 in every
    part, as in its score; a key the function never returned is left out (gdpo then names it)."""
    failed = np.asarray(extra.get(ERRORS_KEY, ()), dtype=np.float64) > 0
    parts = {}
    for key in (k for k in keys or () if k in extra):
        values = np.array(extra[key], copy=True)
        if failed.any() and values.dtype.kind == "f":
            values[failed] = 0.0
        parts[key] = values
    return parts


def _extra_metrics(extra: dict[str, np.ndarray]) -> dict[str, float]:
    out = {}
    for name, arr in numeric_columns(extra).items():
        key = name if "/" in name else f"reward/{name}"
        out[f"{key}/mean" if name != ERRORS_KEY else key] = float(arr.mean() if name != ERRORS_KEY else arr.sum())
    return out
