"""verl 0.9's reward loop inside a training run (`posttrain.trainer.reward_loop`): a GenRM function written as
verl's docs write it trains a tiny model against a judge the run serves itself; a judge that never answers
costs its time-out per row and the run finishes; bad input is one line before the first step; the legacy
and verl 0.9 reward keys are read together, and disagreeing pairs refused."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("httpx")
pytest.importorskip("starlette")

from fake_judge import FakeJudge, dead_url  # noqa: E402
from helpers.tiny_run import tiny_config, tiny_model_dir  # noqa: E402

from posttrain.config import ConfigError  # noqa: E402
from posttrain.rewards import judge as judge_module  # noqa: E402
from posttrain.rewards.manager import RewardManager  # noqa: E402
from posttrain.trainer.reward_loop import RewardLoop  # noqa: E402

GENRM = '''
from posttrain.rewards.judge import chat_complete

GRM_PROMPT_TEMPLATE = "Answer: {answer}\\nSolution: {solution}\\nIs the solution right? Reply 0 or 1."
CALLS = []


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
    grm_prompt = GRM_PROMPT_TEMPLATE.format(answer=ground_truth, solution=solution_str)
    messages = [{"role": "user", "content": grm_prompt}]
    sampling_params = {"temperature": 0.0, "max_tokens": 4}
    result = await chat_complete(router_address=reward_router_address,
                                 chat_complete_request={"messages": messages, **sampling_params})
    grm_response = result.choices[0].message.content
    # a random tiny judge writes noise: its characters' parity is the verdict (varies from row to row)
    score = float(sum(map(ord, grm_response)) % 2)
    CALLS.append((reward_router_address, type(reward_model_tokenizer).__name__, score))
    return {"score": score, "judge_tokens": len(reward_model_tokenizer.encode(grm_response, add_special_tokens=False))}
'''


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture(autouse=True)
def _default_judge_limits():
    yield
    judge_module.set_default_limits()


def _genrm_overrides(tmp_path, function: str, model: str, *extra: str) -> list[str]:
    return [f"reward.custom_reward_function.path={function}", "reward.reward_model.enable=True",
            f"reward.reward_model.model_path={model}", "reward.reward_model.rollout.response_length=8", *extra]


def test_genrm_function_trains_against_the_judge_the_run_serves(tmp_path):
    from posttrain.trainer.trainer import RLTrainer

    fn = _write(tmp_path, "genrm.py", GENRM)
    trainer = RLTrainer(tiny_config(tmp_path, _genrm_overrides(tmp_path, fn, tiny_model_dir(tmp_path, seed=1),
                                                               "trainer.total_training_steps=2")))
    assert isinstance(trainer.reward_fn, RewardLoop) and trainer.reward_fn.source == "GenRM server"
    server = trainer.reward_fn.judge._server
    address, judge_tokenizer = trainer.reward_fn.judge.address, trainer.reward_fn.judge.tokenizer
    history = trainer.fit()
    calls = trainer.reward_fn.compute_score.fn.__globals__["CALLS"]
    assert trainer.reward_fn.judge is None and server._server is None  # the run stopped its judge
    assert len(history) == 2 and len(calls) == 2 * 8  # 4 prompts x 2 samples a step, each row asked the judge once
    assert {c[:2] for c in calls} == {(address, type(judge_tokenizer).__name__)}  # verl's two GenRM arguments
    for step, row in enumerate(history):
        scores = [c[2] for c in calls[8 * step: 8 * step + 8]]
        assert row["critic/score/mean"] == pytest.approx(sum(scores) / 8)  # the judge's verdicts are the reward
        assert row["reward/judge_rows"] == 8 and row["reward/judge_requests"] == 8 and row["reward/judge_failed_rows"] == 0
        assert 1 <= row["reward/judge_server_batches"] <= 8  # concurrent rows decoded together
        assert row["reward/errors"] == 0 and 1 <= row["reward/judge_tokens/mean"] <= 8
    assert any(0 < row["critic/score/mean"] < 1 for row in history)  # verdicts differ: GRPO has something to learn
    assert any(abs(row["actor/pg_loss"]) > 0 for row in history)


HANGING = '''
from posttrain.rewards.judge import chat_complete


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
    result = await chat_complete(router_address=reward_router_address,
                                 chat_complete_request={"messages": [{"role": "user", "content": solution_str}]})
    return float(result.choices[0].message.content == "1")
'''


@pytest.mark.parametrize("manager, concurrent, rounds", [("naive", None, 1), ("limit", 4, 2)])
def test_a_judge_that_never_answers_costs_its_time_out_per_row_and_the_run_finishes(tmp_path, manager, concurrent,
                                                                                    rounds):
    from posttrain.trainer.trainer import RLTrainer

    fn = _write(tmp_path, "hang.py", HANGING)
    extra = ["reward.timeout_s=1.0", "reward.on_error=zero", f"reward.reward_manager.name={manager}",
             "trainer.total_training_steps=2"]
    if concurrent:
        extra.append(f"+reward.max_concurrent={concurrent}")
    with FakeJudge("hang") as fake:
        trainer = RLTrainer(tiny_config(tmp_path, _genrm_overrides(tmp_path, fn, fake.url, *extra)))
        assert trainer.reward_fn.source == "GenRM URL"
        history = trainer.fit()
    assert len(history) == 2
    for row in history:
        # 8 rows, `concurrent` at a time: each row costs its 1 s time-out once, side by side
        assert rounds * 1.0 - 0.1 <= row["timing_s/reward"] <= rounds * 1.0 + 3.0, row["timing_s/reward"]
        assert row["reward/judge_timeout"] + row["reward/timeouts"] == 8  # the judge's or the row's clock, per row
        assert row["critic/score/mean"] == 0.0


# ------------------------------------------------------------------------------------------ bad input
SYNC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip().endswith(str(ground_truth)))
'''
WRONG_SIGNATURE = '''
async def compute_score(text, answer):
    return 1.0
'''


def _one_line_error(tmp_path, overrides) -> str:
    from posttrain.trainer.trainer import RLTrainer

    with pytest.raises(ConfigError) as err:
        RLTrainer(tiny_config(tmp_path, overrides))
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_bad_input_is_one_line_before_the_first_step(tmp_path):
    genrm = _write(tmp_path, "genrm.py", GENRM)
    model = tiny_model_dir(tmp_path)
    # no model path: the config check
    with pytest.raises(ConfigError, match=r"reward.reward_model.enable=True needs reward.reward_model.model_path"):
        tiny_config(tmp_path, [f"reward.custom_reward_function.path={genrm}", "reward.reward_model.enable=True"])
    # a model path that is not there
    assert "reward.reward_model.model_path=/no/such/judge" in _one_line_error(
        tmp_path, _genrm_overrides(tmp_path, genrm, "/no/such/judge"))
    # a judge URL that refuses
    url = dead_url()
    message = _one_line_error(tmp_path, _genrm_overrides(tmp_path, genrm, url))
    assert f"reward.reward_model.model_path={url}" in message and "does not answer GET /models" in message
    # a manager nobody registered
    message = _one_line_error(tmp_path, _genrm_overrides(tmp_path, genrm, model, "reward.reward_manager.name=nope"))
    assert "reward.reward_manager.name='nope' is not a registered reward manager" in message and "'limit'" in message
    # a function with the wrong signature
    wrong = _write(tmp_path, "wrong.py", WRONG_SIGNATURE)
    message = _one_line_error(tmp_path, _genrm_overrides(tmp_path, wrong, model))
    assert "does not accept ['data_source', 'solution_str', 'ground_truth', 'extra_info'" in message
    # a GenRM function without a judge to ask
    message = _one_line_error(tmp_path, [f"reward.custom_reward_function.path={genrm}"])
    assert "requires ['reward_router_address', 'reward_model_tokenizer']" in message
    assert "reward.reward_model.enable=True" in message


@pytest.mark.parametrize("overrides, message", [
    (["custom_reward_function.path=/a.py", "reward.custom_reward_function.path=/b.py"],
     "custom_reward_function.path='/a.py' and reward.custom_reward_function.path='/b.py' set the same thing "
     "differently; verl 0.9.1 would use custom_reward_function.path (the legacy key wins"),
    (["reward_model.reward_manager=dapo", "reward.reward_manager.name=limit"],
     "reward_model.reward_manager='dapo' and reward.reward_manager.name='limit' set the same thing differently"),
    (["reward.reward_model.enable=True", "reward.reward_model.model_path=m", "reward.custom_reward_function.path=/a.py",
      "reward_model.enable=True", "reward_model.micro_batch_size_per_gpu=2"],
     "reward_model.enable=True (a discriminative reward model on the workers) and reward.reward_model.enable=True"),
    # reward.reward_model.enable=True without a function is verl's DisRM: loaded as reward_model.* (test_verl_keys)
    (["+reward.max_rpm=0"], "reward.max_rpm=0.0 must be > 0"),
])
def test_legacy_and_new_keys_that_disagree_are_one_error(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        tiny_config(tmp_path, overrides)
    assert message in str(err.value)


def test_the_classic_path_stays_where_the_tree_does_not_ask(tmp_path):
    from posttrain.config.reward_tree import reward_settings
    from posttrain.trainer.setup import build_reward_fn
    from helpers.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    sync = _write(tmp_path, "sync.py", SYNC)
    for overrides in ([], [f"custom_reward_function.path={sync}"], [f"reward.custom_reward_function.path={sync}"],
                      ["reward.reward_manager.name=dapo"], [f"custom_reward_function.path={sync}",
                                                            f"reward.custom_reward_function.path={sync}"]):
        config = tiny_config(tmp_path, overrides)
        fn = build_reward_fn(config, tok)
        assert isinstance(fn, RewardManager), overrides
        assert getattr(fn.compute_score, "path", None) == reward_settings(config).function_path
    assert build_reward_fn(tiny_config(tmp_path, ["reward.reward_manager.name=dapo"]), tok).record_acc  # verl's dapo
    # the verl 0.9 tree's own managers, and an async function, go to the reward loop
    for overrides in (["reward.reward_manager.name=limit"], ["reward.reward_manager.name=gdpo"],
                      [f"reward.custom_reward_function.path={sync}", "reward.reward_manager.name=remote"]):
        fn = build_reward_fn(tiny_config(tmp_path, overrides), tok)
        assert isinstance(fn, RewardLoop) and fn.source == "rule", overrides
        fn.close()
    asynchronous = _write(tmp_path, "async_rule.py", SYNC.replace("def compute_score", "async def compute_score"))
    fn = build_reward_fn(tiny_config(tmp_path, [f"custom_reward_function.path={asynchronous}"]), tok)
    assert type(fn.manager).__name__ == "NaiveRewardManager" and fn.manager.is_async_reward_score
    fn.close()


def test_verl_limit_keys_reach_the_limit_manager_and_the_judge(tmp_path):
    from helpers.tokenizer import build_tiny_tokenizer
    from posttrain.trainer.setup import build_reward_fn

    config = tiny_config(tmp_path, ["reward.reward_manager.name=limit", "+reward.max_concurrent=3", "+reward.max_rpm=120",
                                    "+reward.max_tpm=6000", "+reward.timeout=7", "reward.on_error=zero"])
    assert config.reward.timeout_s == 7.0  # verl's reward.timeout
    fn = build_reward_fn(config, build_tiny_tokenizer())
    m = fn.manager
    assert (m.max_concurrent, m.max_rpm, m.max_tpm, m.estimated_tokens_per_request, m.timeout_s) == (3, 120, 6000, 2000, 7.0)
    assert judge_module._DEFAULT_LIMITS == {"timeout_s": 7.0, "on_error": "zero", "max_concurrent": 3, "max_rps": 2.0}
    fn.close()
    assert judge_module._DEFAULT_LIMITS == {}  # the run's limits end with it


def test_a_run_counts_only_the_judge_calls_made_during_it():
    """Rows a judge counted before the run's reward loop was built (another run in this process, a notebook cell)
    are not this run's first step's ``reward/judge_rows``; rows counted after it are (the control)."""
    from types import SimpleNamespace

    before = judge_module.Judge("http://127.0.0.1:9/v1")
    before._count("rows", 3)
    loop = RewardLoop(SimpleNamespace(step_metrics=lambda: judge_module.judge_metrics(reset=True)), source="test")
    assert loop.step_metrics()["reward/judge_rows"] == 0
    before._count("rows", 2)
    assert loop.step_metrics()["reward/judge_rows"] == 2
