"""`posttrain diff` on the two blog scripts, and the inputs it reads (scripts, YAML, override lists)."""

import json
from pathlib import Path

import pytest

from posttrain.cli import main as cli
from posttrain.config.load import ConfigError
from posttrain.config.scripts import ConfigSource, explicit_keys, load_source, parse_launch_script, read_source
from posttrain.diff import compare, section_of

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PPO, GRPO = str(EXAMPLES / "ppo_deepseek7b_gsm8k.sh"), str(EXAMPLES / "grpo_deepseek7b_gsm8k.sh")


@pytest.fixture(scope="module")
def blog_diff():
    return compare(read_source(PPO), read_source(GRPO))


def test_blog_scripts_key_differences(blog_diff):
    diffs = {d.key: d for d in blog_diff.keys}
    explicit = {k: (d.a, d.b) for k, d in diffs.items() if d.follows is None}
    assert explicit == {
        "algorithm.adv_estimator": ("gae", "grpo"),
        "data.max_response_length": (512, 1024),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (16, 80),
        "actor_rollout_ref.actor.use_kl_loss": (False, True),
        "actor_rollout_ref.rollout.gpu_memory_utilization": (0.4, 0.6),
        "actor_rollout_ref.rollout.tensor_model_parallel_size": (4, 2),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (32, 160),
        "actor_rollout_ref.rollout.n": (1, 5),
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (None, 160),
        "actor_rollout_ref.ref.fsdp_config.param_offload": (False, True),
        "critic.model.path": ("deepseek-ai/deepseek-llm-7b-chat", "~/models/deepseek-llm-7b-chat"),
        "critic.model.use_remove_padding": (True, False),
        "critic.ppo_micro_batch_size_per_gpu": (32, None),
        # verl's GRPO scripts name their own project, so the two runs keep separate checkpoint folders
        "trainer.project_name": ("verl_example_gsm8k", "verl_grpo_example_gsm8k"),
        "trainer.default_local_dir": ("checkpoints/verl_example_gsm8k/deepseek_llm_7b_function_rm",
                                      "checkpoints/verl_grpo_example_gsm8k/deepseek_llm_7b_function_rm"),
    }
    # present in one script only: the other side takes the default, and says so
    n = diffs["actor_rollout_ref.rollout.n"]
    assert n.a_set is None and n.b_set == f"{GRPO}:30"
    assert diffs["critic.ppo_micro_batch_size_per_gpu"].b_set is None
    assert n.doc.startswith("Responses sampled per prompt")
    # keys set equal on both sides (kl_loss_coef 0.001 is the default) are not differences
    assert "actor_rollout_ref.actor.kl_loss_coef" not in diffs and "critic.optim.lr" not in diffs
    assert diffs["critic.rollout_n"].follows == "actor_rollout_ref.rollout.n"


def test_blog_scripts_grouped_by_section(blog_diff):
    assert list(blog_diff.by_section()) == ["algorithm", "data", "actor", "rollout", "reference", "critic", "trainer"]
    assert section_of("actor_rollout_ref.model.path") == "actor" and section_of("actor_rollout_ref.ref.strategy") == "reference"


def test_blog_scripts_consequences(blog_diff):
    text = "\n".join(blog_diff.consequences)
    assert "B has no critic: adv_estimator=grpo is critic-free" in text
    assert "B adds a reference model for the KL loss (actor.use_kl_loss=True, low_var_kl, coef 0.001)" in text
    assert "B samples 5 responses per prompt (A: 1): 5x the rollout work per prompt" in text
    # 1024 x 5 x 1024 = 5,242,880 response tokens vs 1024 x 1 x 512 = 524,288: 10x
    assert "B generates up to 5,242,880 response tokens per step (A: 524,288): 10x" in text
    assert ("B requests rollout.tensor_model_parallel_size=2 (A: 4), which changes nothing that runs: this build "
            "runs each vllm engine with TP 1 on every rank") in text
    assert "workers of tensor-parallel size" not in text
    assert "actor: B's mini-batch is 160 responses per rank in 2 micro-batches of 80 (A: 32 in 2 of 16)" in text
    assert blog_diff.uses == {"critic": (True, False), "reference": (False, True)}


def test_cli_text_and_json(capsys):
    assert cli(["diff", PPO, GRPO]) == 0
    out = capsys.readouterr().out
    assert "  actor_rollout_ref.rollout.n: 1 (default) -> 5\n      Responses sampled per prompt" in out
    assert "critic  (B has no critic: its keys are unused there)" in out
    assert out.index("\nalgorithm") < out.index("\nrollout") < out.index("\ncritic") < out.index("Consequences")
    assert cli(["diff", PPO, GRPO, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sections"]["algorithm"][0]["b"] == "grpo" and len(data["consequences"]) >= 5


def test_yaml_inline_and_list_file_sources(tmp_path):
    yaml_file = tmp_path / "grpo.yaml"
    yaml_file.write_text("algorithm:\n  adv_estimator: grpo\nactor_rollout_ref:\n  rollout:\n    n: 4\n")
    listed = tmp_path / "overrides.txt"
    listed.write_text("# GRPO with groups of 8\nalgorithm.adv_estimator=grpo\nactor_rollout_ref.rollout.n=8  # bigger\n")
    d = compare(read_source(str(yaml_file)), read_source(str(listed)))
    assert [(k.key, k.a, k.b) for k in d.keys if k.follows is None] == [("actor_rollout_ref.rollout.n", 4, 8)]
    assert d.keys[0].a_set == str(yaml_file) and d.keys[0].b_set == f"{listed}:3"
    inline = compare(read_source("defaults"), read_source("algorithm.adv_estimator=rloo actor_rollout_ref.rollout.n=4"))
    assert any("A trains one" in c for c in inline.consequences) and any("groups of 4 for rloo" in c for c in inline.consequences)


def test_script_parsing_keeps_variables_and_comments():
    text = ('#!/bin/bash\nset -x\n# python3 -m verl.trainer.main_ppo data.train_batch_size=1\n'
            'python3 -m verl.trainer.main_ppo \\\n    data.train_files=$HOME/data/train.parquet \\\n'
            '    data.val_files="${HOME}/data/test.parquet" \\\n    trainer.logger=\'[console,wandb]\' \\\n'
            '    +actor_rollout_ref.model.override_config.attention_dropout=0. $@\n')
    items = parse_launch_script(text, "run.sh")
    assert [(o.key, o.line) for o in items] == [("data.train_files", 5), ("data.val_files", 6), ("trainer.logger", 7),
                                                 ("actor_rollout_ref.model.override_config.attention_dropout", 8)]
    source = ConfigSource("run.sh", "script", overrides=tuple(items))
    config = load_source(source, validate=False)
    assert config.data.train_files == "$HOME/data/train.parquet"
    assert config.data.val_files == "${HOME}/data/test.parquet"  # a shell variable, not an interpolation
    assert config.trainer.logger == ["console", "wandb"]
    assert "actor_rollout_ref.model.override_config" in explicit_keys(source)


def test_bad_inputs_name_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.sh"
    bad.write_text("python3 -m verl.trainer.main_ppo \\\n  algorithm.adv_estimator=grpo \\\n  actor_rollout_ref.rollout.nn=5\n")
    assert cli(["diff", PPO, str(bad)]) == 2
    assert f"{bad}:3 'actor_rollout_ref.rollout.nn=5': unknown config key" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no `python -m ... main_ppo key=value` command found"):
        read_source(str(_write(tmp_path / "empty.sh", "#!/bin/bash\necho hello\n")))
    with pytest.raises(ConfigError, match="no_such_file.sh does not exist; give a launch script, a YAML file"):
        read_source("no_such_file.sh")


def _write(path, text):
    path.write_text(text)
    return path
