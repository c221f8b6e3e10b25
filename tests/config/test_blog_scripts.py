"""The two verl launch scripts from the blog posts load unchanged, with verl's derived sizes."""

from pathlib import Path

from posttrain.config import derive_sizes, load_config, uses_critic, uses_reference, worker_config
from posttrain.config.scripts import read_launch_script

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    return load_config(overrides=[o.text for o in read_launch_script(EXAMPLES / name)])


def test_ppo_script_sizes():
    c = _load("ppo_deepseek7b_gsm8k.sh")
    s = derive_sizes(c)
    assert uses_critic(c) and not uses_reference(c)
    assert (s.world_size, s.dp_size, s.responses_per_step, s.responses_per_rank) == (8, 8, 1024, 128)
    # actor: 256 prompts x 1 sample / 8 ranks = 32 per rank; 32 / 16 = 2 accumulation steps
    assert (s.actor.mini_batch, s.actor.micro_batch, s.actor.grad_accum) == (32, 16, 2)
    # 128 responses per rank / 32 = 4 mini-batches = 4 optimizer steps (ppo_epochs=1)
    assert (s.actor.mini_batches_per_step, s.actor.optimizer_steps_per_step) == (4, 4)
    # critic follows the actor's mini-batch; micro 32 -> no accumulation
    assert (s.critic.mini_batch, s.critic.micro_batch, s.critic.grad_accum) == (32, 32, 1)
    assert s.rollout_log_prob_micro_batch == 32 and s.ref_log_prob_micro_batch is None


def test_grpo_script_sizes():
    c = _load("grpo_deepseek7b_gsm8k.sh")
    s = derive_sizes(c)
    assert not uses_critic(c) and uses_reference(c) and s.critic is None
    # 1024 prompts x 5 = 5120 responses; / 8 = 640 per rank
    assert (s.responses_per_step, s.responses_per_rank) == (5120, 640)
    # 256 x 5 = 1280 / 8 = 160 per rank; / 80 = 2 accumulation steps; 640 / 160 = 4 mini-batches
    assert (s.actor.mini_batch, s.actor.micro_batch, s.actor.grad_accum, s.actor.mini_batches_per_step) == (160, 80, 2, 4)
    assert (s.rollout_log_prob_micro_batch, s.ref_log_prob_micro_batch) == (160, 160)
    assert c.actor_rollout_ref.actor.kl_loss_type == "low_var_kl" and c.actor_rollout_ref.rollout.n == 5


def test_worker_config_holds_per_rank_sizes():
    c = _load("grpo_deepseek7b_gsm8k.sh")
    w = worker_config(c, derive_sizes(c))
    assert w.actor_rollout_ref.actor.ppo_mini_batch_size == 160
    assert c.actor_rollout_ref.actor.ppo_mini_batch_size == 256  # the user's config is untouched
