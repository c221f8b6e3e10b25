"""Pure tensor functions of RL post-training, registered by name, with verl 0.9 semantics.

  advantages.py     advantage estimators (`algorithm.adv_estimator`) and their registry: gae, grpo,
                    grpo_vectorized, gdpo, grpo_passk, rloo, rloo_vectorized, opo, gpg, reinforce_plus_plus
                    (and _baseline), remax
  optimal_token_baseline.py  optimal_token_baseline, tir_optimal_token_baseline: a per-token group
                    baseline weighted by path variance (needs the old-log-prob pass's sum of pi^2)
  policy_losses.py  policy-gradient losses (`actor.policy_loss.loss_mode`) and their registry: vanilla,
                    dppo_tv, dppo_kl, gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, dro, cispo, bypass_mode
  losses.py         agg_loss modes, clipped value loss, entropy loss
  kl.py             KL penalty estimators, fixed/adaptive KL controllers
  logprobs.py       token log-probs, entropies and sums of squared probabilities from logits (the math
                    training uses)
  rollout_correction.py  rollout-vs-trainer mismatch: importance weights, rejection, bypass mode
  utils.py          masked mean/sum/var/whiten
"""

from posttrain.algorithms.advantages import (
    EstimatorSpec,
    EstimatorsWith,
    adv_estimator_spec,
    get_adv_estimator_fn,
    register_adv_est,
    registered_adv_estimators,
)
from posttrain.algorithms.kl import (
    KL_PENALTY_TYPES,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
)
from posttrain.algorithms import optimal_token_baseline  # noqa: F401  (registers its estimators)
from posttrain.algorithms.logprobs import entropy_from_logits, logprob_and_entropy, logprobs_from_logits
from posttrain.algorithms.losses import LOSS_AGG_MODES, agg_loss, compute_entropy_loss, compute_value_loss
from posttrain.algorithms.policy_losses import (PolicyLossSpec, get_policy_loss_fn, policy_loss_spec, register_policy_loss,
                                                registered_policy_losses)
from posttrain.algorithms.rollout_correction import (
    apply_rollout_correction,
    register_rollout_is,
    register_rollout_rs,
    registered_rollout_is,
    registered_rollout_rs,
)
from posttrain.algorithms.utils import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "EstimatorSpec",
    "EstimatorsWith",
    "KL_PENALTY_TYPES",
    "PolicyLossSpec",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "adv_estimator_spec",
    "agg_loss",
    "apply_rollout_correction",
    "compute_entropy_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "logprob_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss_spec",
    "register_adv_est",
    "register_policy_loss",
    "register_rollout_is",
    "register_rollout_rs",
    "registered_adv_estimators",
    "registered_policy_losses",
    "registered_rollout_is",
    "registered_rollout_rs",
]
