"""What each role does on its shard of the batch: the actor (policy updates, log-probs, hybrid
rollout), the frozen reference policy, and the critic (value model). A run builds them all, for one
process or for ranks, with `posttrain.workers.build.build_roles`; a worker built directly (below)
prepares its module in this process by the same steps (`posttrain.workers.prepare`).

    ActorWorker(model_cfg, actor_cfg, rollout_cfg, device=..., module=..., tokenizer=...)
        .compute_log_prob(batch) -> (old_log_probs [N,R], entropy [N,R])
        .update_policy(batch) -> {"actor/pg_loss": ..., ...}
        .generate_sequences(prompts, validate=False) -> Batch
    RefWorker(module, ref_cfg, rollout_cfg).compute_ref_log_prob(batch) -> [N,R]
    CriticWorker(critic_cfg, device=..., module=...).compute_values(batch) -> [N,R]; .update_critic(batch)
"""

from posttrain.workers.actor import ActorWorker, RefWorker
from posttrain.workers.critic import CriticWorker, response_values
from posttrain.optim.build import build_lr_scheduler, build_optimizer

__all__ = ["ActorWorker", "CriticWorker", "RefWorker", "build_lr_scheduler", "build_optimizer", "response_values"]
