"""Each bad-config example of the foundation issue fails with the message it describes."""

import pytest

from posttrain.config import ConfigError, find_problems, load_config

# A small valid base: one process, sizes that divide.
BASE = [
    "trainer.n_gpus_per_node=1",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=2",
]


def test_base_is_valid():
    load_config(overrides=BASE)


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["algorithm.adv_estimator=grpoo"], ["algorithm.adv_estimator='grpoo' is not one of", "grpo", "rloo"]),
        (["actor_rollout_ref.actor.kl_loss_type=low_var"], ["kl_loss_type='low_var' is not one of", "low_var_kl"]),
        (["actor_rollout_ref.actor.loss_agg_mode=mean"], ["loss_agg_mode='mean'", "token-mean"]),
        (["actor_rollout_ref.rollout.name=trt"], ["rollout.name='trt'", "hf, vllm, sglang"]),
        (["trainer.logger=[console,tensorbored]"], ["'tensorbored'", "tensorboard"]),
        (["critic.enable=False"], ["adv_estimator=gae needs a learned critic", "critic.enable=False"]),
        (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"], ["rollout.n=1 gives groups of one"]),
        (["algorithm.adv_estimator=rloo"], ["adv_estimator=rloo", "rollout.n >= 2"]),
        (
            ["data.train_batch_size=60", "actor_rollout_ref.rollout.n=12", "trainer.n_gpus_per_node=6",
             "actor_rollout_ref.actor.ppo_mini_batch_size=60", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"],
            ["60 prompts x 12 samples = 720 responses; 720 / 6 ranks = 120 per rank; "
             "120 is not divisible by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"],
        ),
        (["data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.n_gpus_per_node=2"],
         ["3 prompts x 1 samples = 3 responses; 3 / 2 ranks is not a whole number"]),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=16"], ["ppo_mini_batch_size=16 prompts is larger than data.train_batch_size=8"]),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"], ["ppo_micro_batch_size_per_gpu is not set"]),
        (["actor_rollout_ref.actor.ppo_micro_batch_size=4"], ["are both set", "deprecated"]),
        (["trainer.resume_mode=resume_path"], ["needs trainer.resume_from_path"]),
        (["reward_model.enable=True"], ["reward_model.enable=True", "needs reward_model.micro_batch_size_per_gpu"]),
        (["actor_rollout_ref.actor.clip_ratio_c=0.5"], ["clip_ratio_c=0.5 must be > 1"]),
    ],
)
def test_bad_config_message(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=BASE + overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError, match="2 config problems") as err:
        load_config(overrides=BASE + ["algorithm.adv_estimator=grpoo", "data.truncation=top"])
    assert "data.truncation='top'" in str(err.value)


def test_warnings_for_legal_but_suspicious():
    c = load_config(overrides=BASE + ["algorithm.use_kl_in_reward=True", "actor_rollout_ref.actor.use_kl_loss=True",
                                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"])
    errors, warnings = find_problems(c)
    assert errors == [] and any("KL is used twice" in w for w in warnings)


def test_sequence_parallelism_has_no_effect_and_says_so_naming_the_key():
    """verl's Ulysses sizes (its scripts set 2-8): posttrain keeps whole sequences per rank, the same updates; one
    warning per key (the reference's that follows the actor's is not repeated); size 1 says nothing."""
    from posttrain.config import find_problems, load_config

    base = ["trainer.n_gpus_per_node=2", "critic.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]
    for extra, key in ((["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "actor_rollout_ref.actor"),
                       (["critic.ulysses_sequence_parallel_size=2"], "critic")):
        errors, warnings = find_problems(load_config(validate=False, overrides=[*base, *extra]))
        noted = [w for w in warnings if "ulysses_sequence_parallel_size=2" in w]
        assert not errors and len(noted) == 1 and noted[0].startswith(key) and "no effect here" in noted[0]
    assert not [w for w in find_problems(load_config(validate=False, overrides=base))[1] if "Ulysses" in w]


def test_compiled_layers_on_several_ranks_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.compile_layers=True: .*\(2 ranks") as err:
        load_config(overrides=["actor_rollout_ref.model.compile_layers=True", "trainer.n_gpus_per_node=2"])
    assert "critic.model" not in str(err.value)  # GRPO has no critic: one message
    with pytest.raises(ConfigError, match=r"critic.model.compile_layers=True"):
        load_config(overrides=["critic.model.compile_layers=True", "algorithm.adv_estimator=gae",
                               "trainer.n_gpus_per_node=2"])
    load_config(overrides=BASE + ["actor_rollout_ref.model.compile_layers=True"])  # one rank: fine


def test_prefix_grouper_with_remove_padding_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"use_prefix_grouper=True and actor_rollout_ref.model.use_remove_padding=True"):
        load_config(overrides=BASE + ["actor_rollout_ref.actor.use_prefix_grouper=True",
                                      "actor_rollout_ref.model.use_remove_padding=True"])
    cfg = load_config(overrides=BASE + ["actor_rollout_ref.actor.use_prefix_grouper=True"])
    assert cfg.actor_rollout_ref.ref.use_prefix_grouper is True  # the reference follows the actor


def test_value_ranges_are_checked_for_every_numeric_key():
    """Generic ranges (issue 12): counts >= 1, other numbers >= 0, fractions in [0, 1], verl's -1
    sentinels kept; a key that follows another is reported once, under the key the user set."""
    from posttrain.config import ConfigError, load_config

    builtin = "posttrain/config/builtin.yaml"
    bad = {
        "actor_rollout_ref.actor.ppo_mini_batch_size=-2": "actor_rollout_ref.actor.ppo_mini_batch_size=-2 must be >= 1",
        "actor_rollout_ref.actor.clip_ratio=-0.2": "actor_rollout_ref.actor.clip_ratio=-0.2 must be >= 0",
        "trainer.total_training_steps=0": "trainer.total_training_steps=0 must be >= 1",
        "trainer.save_freq=-2": "trainer.save_freq=-2 must be >= 0 (or -1: off)",
        "reward.timeout_s=-1": "reward.timeout_s=-1.0 must be > 0 (seconds; null: no limit)",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.5": "lr_warmup_steps_ratio=1.5 must be in [0, 1]",
        "actor_rollout_ref.actor.optim.lr=nan": "actor_rollout_ref.actor.optim.lr=nan must be >= 0",
        "critic.ppo_micro_batch_size_per_gpu=0": "critic.ppo_micro_batch_size_per_gpu=0 must be >= 1",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError) as err:
            load_config(base=builtin, overrides=[override])
        assert message in str(err.value), (override, str(err.value))
        assert "critic.ppo_mini_batch_size" not in str(err.value)  # follows the actor's: not reported twice
    for ok in ("trainer.save_freq=-1", "trainer.test_freq=0", "actor_rollout_ref.rollout.top_k=-1",
               "reward.timeout_s=null", "actor_rollout_ref.actor.optim.lr_warmup_steps=-1"):
        load_config(base=builtin, overrides=[ok])


def test_start_up_line_is_exact_when_the_last_mini_batch_is_uneven():
    from posttrain.config import derive_sizes, describe_sizes, load_config

    base = "posttrain/config/builtin.yaml"
    uneven = load_config(base=base, overrides=["data.train_batch_size=5", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                               "actor_rollout_ref.rollout.n=2",
                                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    sizes = derive_sizes(uneven)
    assert sizes.actor.last_mini_batch == 2 and sizes.actor.mini_batches_per_step == 3
    assert ("actor: 3 mini-batches per rank: 2 of 4 responses (1 micro-batch of 4 each) and a last one of 2 "
            "(one micro-batch of 2); 3 optimizer steps per training step") in describe_sizes(sizes)
    even = derive_sizes(load_config(base=base))
    assert even.actor.last_mini_batch is None
    assert "actor: 1 mini-batch of 32 responses per rank, 2 micro-batches of 16 each (gradient accumulation); 1 optimizer" in describe_sizes(even)
    assert "old log-prob: no separate pass (the on-policy update's own forward gives them)" in describe_sizes(even)
    assert even.prompts_shared and "each distinct prompt of a micro-batch encoded once" in describe_sizes(even)
    one_sample = derive_sizes(load_config(base=base, overrides=["actor_rollout_ref.rollout.n=1",
                                                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                                                                "algorithm.adv_estimator=reinforce_plus_plus"]))
    assert one_sample.prompts_shared and "each distinct prompt" not in describe_sizes(one_sample)
    assert "the beginning the prompts of a micro-batch share encoded once" in describe_sizes(one_sample)


def test_per_batch_seeds_on_an_engine_without_them_are_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"rollout.seed_per_batch=True with actor_rollout_ref.rollout.name=vllm"):
        load_config(overrides=BASE + ["actor_rollout_ref.rollout.seed_per_batch=True",
                                      "actor_rollout_ref.rollout.name=vllm"])
    assert load_config(overrides=BASE + ["actor_rollout_ref.rollout.seed_per_batch=True"]).actor_rollout_ref.rollout.seed_per_batch
