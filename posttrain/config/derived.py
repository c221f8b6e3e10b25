"""Batch sizes derived from the config, computed exactly as verl's workers compute them.

verl normalises inside each worker: `ppo_mini_batch_size *= rollout.n`, then
`//= world_size // ulysses_sp`; a deprecated global micro-batch size is divided the same way.
Here it happens once, right after the config loads, every check shows its arithmetic, and the
workers receive the per-rank numbers through `worker_config()`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any, Optional

from posttrain.config.schema import PostTrainConfig


@dataclass(frozen=True)
class RoleSizes:
    """Per-rank sizes of one trained role (actor or critic)."""

    mini_batch: int
    """Responses per optimizer step on one rank."""
    micro_batch: Optional[int]
    """Responses per forward/backward on one rank (None with dynamic batch size)."""
    grad_accum: Optional[int]
    """Micro-batches accumulated per optimizer step."""
    mini_batches_per_step: int
    """Optimizer steps per epoch over one training batch."""
    optimizer_steps_per_step: int
    """ppo_epochs x mini_batches_per_step."""
    last_mini_batch: Optional[int] = None
    """Responses in the last mini-batch of a step on one rank when it is smaller than the others (else None)."""
    max_token_len: Optional[int] = None
    """With ``use_dynamic_bsz``: the token budget of a micro-batch (``ppo_max_token_len_per_gpu``), else None."""


@dataclass(frozen=True)
class DerivedSizes:
    world_size: int
    """nnodes x n_gpus_per_node."""
    dp_size: int
    """Data-parallel ranks: world_size / ulysses_sequence_parallel_size."""
    prompts_per_step: int
    """data.train_batch_size."""
    responses_per_step: int
    """train_batch_size x rollout.n."""
    responses_per_rank: int
    """responses_per_step / world_size."""
    actor: RoleSizes
    """Actor update sizes."""
    critic: Optional[RoleSizes]
    """Critic update sizes (None without a critic)."""
    rollout_log_prob_micro_batch: Optional[int]
    """Responses per old-log-prob pass on one rank."""
    ref_log_prob_micro_batch: Optional[int]
    """Responses per reference pass on one rank."""
    old_log_probs_from: str = "recompute"
    """Where the old log-probs come from: recompute (a no-grad actor pass), update (the on-policy
    update's own forward; the pass is skipped) or rollout (bypass_mode). See `old_log_probs_source`."""
    prompts_shared: bool = False
    """actor.use_prefix_grouper: the actor and reference forwards encode each distinct prompt once for
    its responses (rollout.n > 1) and the beginning the prompts of a micro-batch share once."""

    def as_dict(self) -> dict:
        return asdict(self)


def uses_critic(config: PostTrainConfig) -> bool:
    """verl's rule: critic.enable, or (when null) exactly for an estimator that needs one (gae;
    declared with its registration, `posttrain.algorithms.EstimatorSpec.needs_critic`)."""
    if config.critic.enable is not None:
        return bool(config.critic.enable)
    return estimator_needs(config.algorithm.adv_estimator, "needs_critic")


def estimator_needs(name: str, need: str) -> bool:
    """Whether the registered estimator `name` declares `need` (False for an unknown name, which the
    choices check reports)."""
    from posttrain.algorithms import EstimatorsWith

    return name in EstimatorsWith(need)


def uses_reference(config: PostTrainConfig) -> bool:
    """A reference model is loaded for a KL term: the actor's KL loss (unless its coefficient is 0, as TRL
    skips the reference at ``beta=0``: the term would add nothing) or the in-reward KL penalty."""
    return bool(kl_loss_active(config.actor_rollout_ref.actor) or config.algorithm.use_kl_in_reward)


def kl_loss_active(actor: Any) -> bool:
    """``actor.use_kl_loss`` with a non-zero ``actor.kl_loss_coef``."""
    return bool(actor.use_kl_loss) and actor.kl_loss_coef != 0


class SizeError(ValueError):
    """A batch-size inconsistency; the message shows the arithmetic."""


def _per_rank_micro(section: str, global_key: str, per_gpu_key: str, global_value, per_gpu_value, dp: int) -> Optional[int]:
    """Resolve verl's deprecated global micro-batch size against the per-GPU one."""
    if global_value is not None and per_gpu_value is not None:
        raise SizeError(
            f"{section}.{global_key}={global_value} and {section}.{per_gpu_key}={per_gpu_value} are both set; "
            f"set only {section}.{per_gpu_key} ({global_key} is deprecated)"
        )
    if global_value is not None:
        if global_value // dp == 0:
            raise SizeError(f"{section}.{global_key}={global_value} / {dp} ranks = 0 per rank; raise it to at least {dp}")
        return global_value // dp
    return per_gpu_value


def _role_sizes(section: str, prompts_per_mini: int, n: int, dp: int, global_micro, per_gpu_micro, dynamic: bool,
                epochs: int, responses_per_step: int, max_token_len: Optional[int] = None) -> RoleSizes:
    responses = prompts_per_mini * n
    head = f"{section}.ppo_mini_batch_size: {prompts_per_mini} prompts x {n} samples = {responses} responses"
    if responses % dp:
        raise SizeError(f"{head}; {responses} / {dp} ranks is not a whole number; make it a multiple of {dp}")
    mini = responses // dp
    responses_per_dp_rank = responses_per_step // dp
    if mini == 0:
        raise SizeError(f"{head}; {responses} / {dp} ranks = 0 per rank")
    micro = _per_rank_micro(section, "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", global_micro, per_gpu_micro, dp)
    accum = None
    if not dynamic:
        if micro is None:
            raise SizeError(
                f"{section}.ppo_micro_batch_size_per_gpu is not set; set it (responses per forward/backward on one "
                f"rank, a divisor of {mini}) or set use_dynamic_bsz=True"
            )
        if micro <= 0 or mini % micro:
            raise SizeError(
                f"{head}; {responses} / {dp} ranks = {mini} per rank; {mini} is not divisible by "
                f"{section}.ppo_micro_batch_size_per_gpu={micro}"
            )
        accum = mini // micro
    per_step = -(-responses_per_dp_rank // mini)  # a smaller last mini-batch is allowed, as in verl
    last = responses_per_dp_rank - (per_step - 1) * mini
    return RoleSizes(mini, micro, accum, per_step, epochs * per_step, last if last != mini else None,
                     max_token_len if dynamic else None)


def _log_prob_micro(section: str, global_value, per_gpu_value, dp: int, dynamic: bool, needed: bool) -> Optional[int]:
    micro = _per_rank_micro(section, "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu", global_value, per_gpu_value, dp)
    if needed and micro is None and not dynamic:
        raise SizeError(
            f"{section}.log_prob_micro_batch_size_per_gpu is not set; set it (responses per log-prob forward pass "
            f"on one rank) or set {section}.log_prob_use_dynamic_bsz=True"
        )
    if micro is not None and micro <= 0:
        raise SizeError(f"{section}.log_prob_micro_batch_size_per_gpu={micro} must be positive")
    return micro


def derive_sizes(config: PostTrainConfig) -> DerivedSizes:
    """All derived batch sizes; raises SizeError with the arithmetic when they do not fit."""
    arr = config.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    if world <= 0:
        raise SizeError(f"trainer.nnodes={config.trainer.nnodes} x trainer.n_gpus_per_node={config.trainer.n_gpus_per_node} must be positive")
    sp = actor.ulysses_sequence_parallel_size
    if sp <= 0 or world % sp:
        raise SizeError(f"{world} ranks are not divisible by actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}")
    dp = world // sp
    n, tbs = rollout.n, config.data.train_batch_size
    responses = tbs * n
    if responses % world:
        raise SizeError(
            f"data.train_batch_size: {tbs} prompts x {n} samples = {responses} responses; {responses} / {world} ranks "
            f"is not a whole number; make data.train_batch_size x actor_rollout_ref.rollout.n a multiple of {world}"
        )
    if actor.ppo_mini_batch_size > tbs:
        raise SizeError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} prompts is larger than "
            f"data.train_batch_size={tbs}; a mini-batch cannot exceed the training batch"
        )
    per_rank = responses // world
    actor_sizes = _role_sizes("actor_rollout_ref.actor", actor.ppo_mini_batch_size, n, dp, actor.ppo_micro_batch_size,
                              actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz, actor.ppo_epochs, responses,
                              actor.ppo_max_token_len_per_gpu)
    critic_sizes = None
    if uses_critic(config):
        c = config.critic
        c_dp = world // c.ulysses_sequence_parallel_size
        critic_sizes = _role_sizes("critic", c.ppo_mini_batch_size, c.rollout_n, c_dp, c.ppo_micro_batch_size,
                                   c.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz, c.ppo_epochs, responses,
                                   c.ppo_max_token_len_per_gpu)
    rollout_micro = _log_prob_micro("actor_rollout_ref.rollout", rollout.log_prob_micro_batch_size,
                                    rollout.log_prob_micro_batch_size_per_gpu, dp, rollout.log_prob_use_dynamic_bsz, True)
    ref = arr.ref
    ref_micro = None
    if uses_reference(config):
        ref_micro = _log_prob_micro("actor_rollout_ref.ref", ref.log_prob_micro_batch_size,
                                    ref.log_prob_micro_batch_size_per_gpu, dp, ref.log_prob_use_dynamic_bsz, True)
    return DerivedSizes(world, dp, tbs, responses, per_rank, actor_sizes, critic_sizes, rollout_micro, ref_micro,
                        old_log_probs_source(config, actor_sizes),
                        bool(config.actor_rollout_ref.actor.use_prefix_grouper))


def old_log_probs_source(config: PostTrainConfig, actor_sizes: RoleSizes) -> str:
    """Where a step's old log-probs come from: ``rollout`` (``rollout_correction.bypass_mode``),
    ``update`` or ``recompute`` (a separate no-grad pass of the actor, verl's ``compute_log_prob``).

    ``update``: when the actor's update is one epoch of one mini-batch, the policy cannot move
    before it is evaluated, so the update's own first forward, detached, is exactly what the extra
    pass would compute (verl's ``on_policy`` branch of ``update_policy``). The pass is skipped
    unless something reads the old log-probs before the update: KL in the reward, a rollout
    correction that weighs or rejects tokens, or ``actor.calculate_sum_pi_squared`` (the pass also
    sums pi^2 over the vocabulary, for optimal_token_baseline). The actor then reports the entropy and the
    rollout/actor log-prob gap from that forward instead."""
    correction = config.algorithm.rollout_correction
    if correction.bypass_mode:
        return "rollout"
    on_policy = config.actor_rollout_ref.actor.ppo_epochs == 1 and actor_sizes.mini_batches_per_step == 1
    read_before_update = (config.algorithm.use_kl_in_reward or correction.rollout_is is not None
                          or correction.rollout_rs is not None
                          or config.actor_rollout_ref.actor.calculate_sum_pi_squared)  # the pass computes it
    return "update" if on_policy and not read_before_update else "recompute"


def worker_config(config: PostTrainConfig, sizes: DerivedSizes) -> PostTrainConfig:
    """A copy whose batch sizes are per rank, in responses: what verl's workers hold after normalising."""
    out = copy.deepcopy(config)
    actor, critic = out.actor_rollout_ref.actor, out.critic
    actor.use_kl_loss = kl_loss_active(actor)  # a zero coefficient: no term, no reference (`uses_reference`)
    actor.ppo_mini_batch_size = sizes.actor.mini_batch
    actor.ppo_micro_batch_size, actor.ppo_micro_batch_size_per_gpu = None, sizes.actor.micro_batch
    out.actor_rollout_ref.rollout.log_prob_micro_batch_size = None
    out.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = sizes.rollout_log_prob_micro_batch
    out.actor_rollout_ref.ref.log_prob_micro_batch_size = None
    out.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu = sizes.ref_log_prob_micro_batch or sizes.rollout_log_prob_micro_batch
    if sizes.critic is not None:
        critic.ppo_mini_batch_size = sizes.critic.mini_batch
        critic.ppo_micro_batch_size, critic.ppo_micro_batch_size_per_gpu = None, sizes.critic.micro_batch
        if critic.forward_micro_batch_size_per_gpu is None:
            critic.forward_micro_batch_size_per_gpu = sizes.critic.micro_batch
    return out


def _describe_old_log_probs(sizes: DerivedSizes) -> str:
    if sizes.old_log_probs_from == "update":
        return "old log-prob: no separate pass (the on-policy update's own forward gives them)"
    if sizes.old_log_probs_from == "rollout":
        return "old log-prob: the rollout engine's (algorithm.rollout_correction.bypass_mode)"
    return f"old log-prob: micro-batches of {sizes.rollout_log_prob_micro_batch} responses per rank"


def describe_sizes(sizes: DerivedSizes) -> str:
    """Human-readable derived sizes (printed at start-up and by `posttrain config`)."""
    a = sizes.actor
    lines = [
        f"{sizes.prompts_per_step} prompts x {sizes.responses_per_step // sizes.prompts_per_step} samples = "
        f"{sizes.responses_per_step} responses per step; / {sizes.world_size} ranks = {sizes.responses_per_rank} per rank",
        f"actor: {_mini_batches(a, ' (gradient accumulation)')}; {a.optimizer_steps_per_step} optimizer steps per "
        "training step",
        _describe_old_log_probs(sizes),
    ]
    if sizes.ref_log_prob_micro_batch is not None:
        lines.append(f"reference: micro-batches of {sizes.ref_log_prob_micro_batch} responses per rank")
    if sizes.prompts_shared:
        each = "each distinct prompt of a micro-batch encoded once for its responses, and " if (
            sizes.responses_per_step > sizes.prompts_per_step) else ""
        lines.append(f"actor and reference forwards: {each}(on CPU with sdpa attention) the beginning the prompts of "
                     "a micro-batch share encoded once (actor.use_prefix_grouper; the plain forward where that costs less)")
    if sizes.critic is not None:
        c = sizes.critic
        lines.append(f"critic: {_mini_batches(c, '')}")
    return "\n".join(lines)


def _micro_split(responses: int, micro: Optional[int], max_token_len: Optional[int] = None) -> str:
    """'2 micro-batches of 4' / '2 micro-batches of 4 and one of 1' / 'one micro-batch of 3' / 'micro-batches of
    at most 640 tokens (use_dynamic_bsz)'."""
    if max_token_len is not None:
        return f"micro-batches of at most {max_token_len} tokens (use_dynamic_bsz)"
    if micro is None:
        return "dynamic micro-batches"
    full, rest = divmod(responses, micro)
    parts = []
    if full:
        parts.append(f"{full} micro-batch{'es' if full > 1 else ''} of {micro}")
    if rest:
        parts.append(f"one of {rest}" if full else f"one micro-batch of {rest}")
    return " and ".join(parts)


def _mini_batches(r: RoleSizes, accum_note: str) -> str:
    """Exact per-rank mini-batch description, the smaller last mini-batch included."""
    if r.last_mini_batch is None:
        return (f"{r.mini_batches_per_step} mini-batch{'es' if r.mini_batches_per_step > 1 else ''} of {r.mini_batch} "
                f"responses per rank, {_micro_split(r.mini_batch, r.micro_batch, r.max_token_len)} each"
                + (accum_note if (r.grad_accum or 0) > 1 else ""))
    full = r.mini_batches_per_step - 1
    return (f"{r.mini_batches_per_step} mini-batches per rank: {full} of {r.mini_batch} responses "
            f"({_micro_split(r.mini_batch, r.micro_batch, r.max_token_len)} each) and a last one of {r.last_mini_batch} "
            f"({_micro_split(r.last_mini_batch, r.micro_batch, r.max_token_len)})" + (accum_note if (r.grad_accum or 0) > 1 else ""))
