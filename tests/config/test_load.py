"""Loading: defaults, YAML layers and verl-style overrides, with errors that name the key."""

import pytest

from posttrain.config import ConfigError, load_config, parse_value
from posttrain.config.docs import all_keys, iter_keys


def test_defaults_are_verls():
    c = load_config(validate=False)
    arr = c.actor_rollout_ref
    # Spot checks against verl 0.9's ppo_trainer.yaml.
    assert c.algorithm.adv_estimator == "gae"
    assert c.algorithm.kl_ctrl.kl_coef == 0.001 and c.algorithm.kl_ctrl.horizon == 10000
    assert arr.actor.ppo_mini_batch_size == 256 and arr.actor.clip_ratio_c == 3.0
    assert arr.actor.kl_loss_type == "low_var_kl" and arr.actor.optim.lr == 1e-6
    assert c.critic.optim.lr == 1e-5 and c.critic.cliprange_value == 0.5
    assert c.data.train_batch_size == 1024 and c.data.truncation == "error"
    assert c.trainer.total_epochs == 30 and c.trainer.n_gpus_per_node == 8


def test_interpolated_defaults_follow_their_source():
    c = load_config(overrides=["data.max_response_length=77", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                               "actor_rollout_ref.rollout.n=3", "trainer.project_name=p", "trainer.experiment_name=e"],
                    validate=False)
    assert c.actor_rollout_ref.rollout.response_length == 77
    assert c.critic.ppo_mini_batch_size == 8 and c.critic.rollout_n == 3
    assert c.trainer.default_local_dir == "checkpoints/p/e"


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("trainer.logger=[console,wandb]", "trainer.logger", ["console", "wandb"]),
        ("trainer.logger=['console','file']", "trainer.logger", ["console", "file"]),
        ("trainer.logger=console", "trainer.logger", ["console"]),
        ("trainer.resume_from_path=null", "trainer.resume_from_path", None),
        ("actor_rollout_ref.actor.optim.lr=3e-6", "actor_rollout_ref.actor.optim.lr", 3e-6),
        ("data.truncation='error'", "data.truncation", "error"),
        ("trainer.experiment_name=\"a b\"", "trainer.experiment_name", "a b"),
        ("data.filter_overlong_prompts=True", "data.filter_overlong_prompts", True),
        ("+actor_rollout_ref.model.override_config.attention_dropout=0.", "actor_rollout_ref.model.override_config",
         {"attention_dropout": 0.0}),
        ("++actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.n", 4),
    ],
)
def test_override_syntax(override, key, expected):
    c = load_config(overrides=[override], validate=False)
    node = c
    for part in key.split("."):
        node = getattr(node, part)
    assert node == expected


def test_unknown_key_names_full_key_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["algorithm.adv_estimatorr=grpo"], validate=False)
    assert "'algorithm.adv_estimatorr'" in str(err.value) and "did you mean algorithm.adv_estimator" in str(err.value)
    with pytest.raises(ConfigError, match="did you mean actor_rollout_ref.rollout.n"):
        load_config(overrides=["rollout.n=5"], validate=False)


def test_plus_does_not_invent_schema_keys():
    with pytest.raises(ConfigError, match="unknown config key 'trainer.nonsense'"):
        load_config(overrides=["+trainer.nonsense=1"], validate=False)


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["actor_rollout_ref.rollout.n=five"], validate=False)
    msg = str(err.value)
    assert "actor_rollout_ref.rollout.n" in msg and "'five'" in msg and "expected int" in msg


def test_yaml_file_layer_and_errors_name_file_and_line(tmp_path):
    good = tmp_path / "run.yaml"
    good.write_text("algorithm:\n  adv_estimator: grpo\nactor_rollout_ref:\n  rollout:\n    n: 4\n")
    c = load_config(good, ["actor_rollout_ref.rollout.n=6"], validate=False)
    assert c.algorithm.adv_estimator == "grpo" and c.actor_rollout_ref.rollout.n == 6  # overrides win
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_epochs: 2\n  totl_steps: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3: unknown config key 'trainer.totl_steps'"):
        load_config(bad, validate=False)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml", validate=False)


def test_verl_yaml_plumbing_is_ignored(tmp_path):
    f = tmp_path / "verl.yaml"
    f.write_text("defaults:\n  - actor@actor_rollout_ref.actor: dp_actor\nalgorithm:\n  _target_: verl.trainer.config.AlgoConfig\n  gamma: 0.9\n")
    assert load_config(f, validate=False).algorithm.gamma == 0.9


def test_every_key_has_a_doc_string():
    undocumented = [k.key for k in iter_keys() if not k.doc]
    assert undocumented == []
    assert len(all_keys()) > 200


def test_parse_value_follows_yaml():
    assert parse_value("[a,b]") == ["a", "b"]
    assert parse_value("null") is None
    assert parse_value("1e-6") == 1e-6
    assert parse_value("'x y'") == "x y"
