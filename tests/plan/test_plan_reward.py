"""`posttrain plan`'s reward section: where the reward comes from (rule, DisRM, GenRM server, GenRM URL), the
manager, where the judge runs and on what, and the limits; a manager nobody registered is a plan error."""

from __future__ import annotations

from posttrain.config import load_config
from posttrain.plan import build_plan
from posttrain.plan.report import render_reward
from posttrain.plan.reward import reward_plan

GENRM = "async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,\n" \
        "                        reward_model_tokenizer):\n    return 1.0\n"


def _plan(tmp_path, *overrides):
    fn = tmp_path / "judge.py"
    fn.write_text(GENRM)
    keys = [o.replace("FN", str(fn)) for o in overrides]
    return reward_plan(load_config(overrides=["actor_rollout_ref.model.path=m", "trainer.n_gpus_per_node=1", *keys],
                                   validate=False))


def test_rule_reward_by_default(tmp_path):
    plan = _plan(tmp_path)
    assert plan["source"] == "rule" and not plan["reward_loop"]
    assert plan["manager"] == "naive (posttrain's RewardManager, in this process)"
    assert plan["limits"] == ["60 s a row (reward.timeout_s)", "a failed row: the run stops, naming it (reward.on_error=raise)"]


def test_genrm_served_by_the_run_in_one_process_and_on_its_own_ray_pool(tmp_path):
    genrm = ["reward.custom_reward_function.path=FN", "reward.reward_model.enable=True", "reward.reward_model.model_path=j",
             "reward.reward_manager.name=limit", "+reward.max_concurrent=4", "+reward.max_rpm=600", "reward.timeout_s=20"]
    plan = _plan(tmp_path, *genrm)
    assert plan["source"] == "GenRM server" and plan["reward_loop"]
    assert plan["function"].endswith("(from reward.custom_reward_function.path), async def; receives "
                                     "reward_router_address and reward_model_tokenizer")
    assert plan["judge"]["where"].startswith("this process on 127.0.0.1 (posttrain serve, hf engine")
    assert plan["limits"][2:] == ["limit manager: 4 row(s) at once, 600 requests/min",
                                  "judge requests: 4 in flight, 20 s each with retries, 600/min; identical requests "
                                  "answered once (cache)"]
    ray = _plan(tmp_path, *genrm, "trainer.n_gpus_per_node=2", "trainer.device=cpu",
                "reward.reward_model.enable_resource_pool=True", "reward.reward_model.nnodes=1",
                "reward.reward_model.n_gpus_per_node=1")
    assert ray["judge"]["where"].startswith("a Ray actor of its own") and ray["judge"]["resources"] == \
        "its own resource pool: 1 CPU(s)"
    driver = _plan(tmp_path, *genrm, "trainer.n_gpus_per_node=2")
    assert driver["judge"]["where"].startswith("the driver process (Ray ranks send their responses there")
    text = "\n".join(render_reward(plan))
    assert text.startswith("Reward\n  source        GenRM server\n")


def test_genrm_url_and_a_manager_nobody_registered(tmp_path):
    plan = _plan(tmp_path, "reward.custom_reward_function.path=FN", "reward.reward_model.enable=True",
                 "reward.reward_model.model_path=http://judge.example:8000/v1", "reward.reward_manager.name=nope")
    assert plan["source"] == "GenRM URL" and plan["judge"]["resources"] == "none of this run's"
    assert plan["problem"].startswith("reward.reward_manager.name='nope' is not a registered reward manager")
    assert "judge requests: 8 in flight" in plan["limits"][-1]


def test_the_plan_names_the_judge_in_models_and_reward(tmp_path):
    fn = tmp_path / "judge.py"
    fn.write_text(GENRM)
    config = load_config(overrides=["actor_rollout_ref.model.path=m", f"reward.custom_reward_function.path={fn}",
                                    "reward.reward_model.enable=True", "reward.reward_model.model_path=judge_model"],
                         validate=False)
    plan = build_plan(config)
    row = next(m for m in plan.models if m["role"] == "reward model")
    assert row["loaded"] and row["model"] == "judge_model" and "reward.reward_model.enable=True" in row["why"]
    assert plan.as_dict()["reward"]["source"] == "GenRM server"
