"""The learned reward model (reward_model.enable): its scores against a direct forward of the model,
micro-batching, re-templating with the reward model's own chat template, the combination with the
rule-based reward, a tiny PPO run, and the start-up errors for bad settings."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from helpers.tiny_reward_model import build_rm_tokenizer, tiny_reward_model, tiny_reward_model_dir
from helpers.tiny_run import tiny_config, tiny_model_dir
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.host import paging
from posttrain.distributed.placement import InProcess
from posttrain.batch import Batch, to_object_array
from posttrain.config import ConfigError
from posttrain.config.critic import RewardModelConfig
from posttrain.rewards.rm_combine import RM_SCORE_KEY, score_responses, validation_skip_reason
from posttrain.workers.group import LocalWorkerGroup
from posttrain.workers.reward_model import RewardModelWorker

CHATS = [
    [{"role": "user", "content": "What is 1 + 1?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 * 3?"}],
    [{"role": "user", "content": "Say hi."}],
    [{"role": "user", "content": "What is 9 - 4?"}],
    [{"role": "user", "content": "Count to three."}],
]
RESPONSES = ["2\n#### 2", "21", "hello there, friend", "#### 5", "one two three four five six"]
R = 32  # response columns (every response fits, with padding after its eos)


def rollout_batch(actor_tok, chats=CHATS, responses=RESPONSES, eos=True) -> Batch:
    """What generation returns: left-padded prompts (the actor's template) + right-padded responses
    ending in the actor's eos, with raw_prompt, response_mask and the rule-reward fields."""
    prompts = [actor_tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    p_ids = [actor_tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [actor_tok(r, add_special_tokens=False)["input_ids"] + ([actor_tok.eos_token_id] if eos else [])
             for r in responses]
    n, width = len(chats), max(len(p) for p in p_ids)
    pad = actor_tok.pad_token_id
    prompt_t, prompt_m = torch.full((n, width), pad), torch.zeros(n, width, dtype=torch.long)
    resp_t, resp_m = torch.full((n, R), pad), torch.zeros(n, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(p_ids, r_ids)):
        prompt_t[i, width - len(p):], prompt_m[i, width - len(p):] = torch.tensor(p), 1
        resp_t[i, :len(r)], resp_m[i, :len(r)] = torch.tensor(r), 1
    mask = torch.cat([prompt_m, resp_m], 1)
    tensors = {"prompts": prompt_t, "responses": resp_t, "input_ids": torch.cat([prompt_t, resp_t], 1),
               "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "response_mask": resp_m}
    answers = [r.split("#### ")[-1] for r in responses]
    non_tensors = {"raw_prompt": to_object_array(list(c) for c in chats),
                   "data_source": np.array(["posttrain/arithmetic"] * n, dtype=object),
                   "reward_model": np.array([{"style": "rule", "ground_truth": a} for a in answers], dtype=object)}
    return Batch.from_dict(tensors, non_tensors)


def rm_config(**overrides) -> RewardModelConfig:
    cfg = RewardModelConfig(enable=True, micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                            forward_max_token_len_per_gpu=4096)
    cfg.model.input_tokenizer = "<actor>"
    cfg.model.external_lib = None
    cfg.model.fsdp_config.mixed_precision.param_dtype = "fp32"
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(scope="module")
def toks():
    return build_tiny_tokenizer(), build_rm_tokenizer()


@pytest.fixture(scope="module")
def rm_module(toks):
    return tiny_reward_model(toks[1])


def worker(rm_module, toks, retemplate=True, **cfg) -> RewardModelWorker:
    actor_tok, rm_tok = toks
    config = rm_config(**cfg)
    micro = config.micro_batch_size_per_gpu
    return RewardModelWorker(rm_module, config, rm_tokenizer=rm_tok, input_tokenizer=actor_tok if retemplate else None,
                             micro_batch_size=micro)


def direct_score(model, tok, text: str) -> float:
    """An independent reference: one unpadded row through the model's own forward (transformers
    pools the last token, which is not a pad token here)."""
    return direct_score_of_ids(model, tok(text, add_special_tokens=False)["input_ids"])


def direct_score_of_ids(model, ids) -> float:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids)[None]).logits[0, 0].item()


def rm_text(chat, response) -> str:
    """The reward model's template written out by hand: ``[role]: content`` lines."""
    return "".join(f"[{m['role']}]: {m['content']}\n" for m in chat) + f"[assistant]: {response}\n"


# ---------------------------------------------------------------------------------------------- scores
def test_scores_equal_a_direct_forward_on_the_last_response_token(rm_module, toks):
    batch = rollout_batch(toks[0])
    scores = worker(rm_module, toks).compute_rm_score(batch)
    assert scores.shape == (len(CHATS), R) and scores.dtype == torch.float32
    lengths = batch["response_mask"].sum(-1)
    for i, (chat, response) in enumerate(zip(CHATS, RESPONSES)):
        want = direct_score(rm_module, toks[1], rm_text(chat, response))
        last = int(lengths[i]) - 1
        assert scores[i, last].item() == pytest.approx(want, abs=1e-5)
        assert torch.count_nonzero(scores[i]) == 1  # zeros everywhere else
    assert scores.sum(-1).std() > 0.05  # the texts score differently: equality above means something


def test_actor_tokens_as_they_are_when_input_tokenizer_is_null(rm_module, toks):
    """input_tokenizer=null: the reward model reads the actor's full sequence (prompt + response)."""
    batch = rollout_batch(toks[0])
    scores = worker(rm_module, toks, retemplate=False).compute_rm_score(batch)
    for i in range(len(CHATS)):
        want = direct_score_of_ids(rm_module, batch["input_ids"][i][batch["attention_mask"][i].bool()])
        assert scores[i].sum().item() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("retemplate", [True, False])
def test_micro_batching_does_not_change_scores(rm_module, toks, retemplate):
    batch = rollout_batch(toks[0])
    reference = worker(rm_module, toks, retemplate, micro_batch_size_per_gpu=len(CHATS)).compute_rm_score(batch)
    for micro in (1, 2, 3):
        got = worker(rm_module, toks, retemplate, micro_batch_size_per_gpu=micro).compute_rm_score(batch)
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)
    dynamic = worker(rm_module, toks, retemplate, micro_batch_size_per_gpu=None, use_dynamic_bsz=True,
                     forward_max_token_len_per_gpu=80).compute_rm_score(batch)
    torch.testing.assert_close(dynamic, reference, rtol=0, atol=1e-5)


def test_the_reward_model_is_frozen_in_eval_mode(rm_module, toks):
    w = worker(rm_module, toks)
    assert not w.module.training and not any(p.requires_grad for p in w.module.parameters())
    scores = w.compute_rm_score(rollout_batch(toks[0]))
    assert not scores.requires_grad


# ---------------------------------------------------------------------------------------------- re-templating
def test_retemplating_renders_the_decoded_chat_with_the_reward_models_template(rm_module, toks):
    actor_tok, rm_tok = toks
    batch = rollout_batch(actor_tok)
    w = worker(rm_module, toks)
    texts = w.texts(batch)
    # the actor's template (ChatML-like) is gone; the response's eos text is dropped, as verl does
    assert texts[0] == "[user]: What is 1 + 1?\n[assistant]: 2\n#### 2\n"
    assert texts[1] == "[system]: Be brief.\n[user]: What is 7 * 3?\n[assistant]: 21\n"
    assert all("<|im_start|>" not in t and "<|im_end|>" not in t for t in texts)
    inputs = w.model_inputs(batch)
    first = inputs["input_ids"][0][inputs["attention_mask"][0].bool()].tolist()
    assert first == rm_tok(texts[0], add_special_tokens=False)["input_ids"]
    assert inputs["attention_mask"][:, 0].all()  # right-padded: every row starts at column 0


def test_max_length_cuts_from_the_right(rm_module, toks):
    batch = rollout_batch(toks[0])
    scores = worker(rm_module, toks, max_length=12).compute_rm_score(batch)
    for i, (chat, response) in enumerate(zip(CHATS, RESPONSES)):
        want = direct_score_of_ids(rm_module, toks[1](rm_text(chat, response), add_special_tokens=False)["input_ids"][:12])
        assert scores[i].sum().item() == pytest.approx(want, abs=1e-5)
    assert worker(rm_module, toks).compute_rm_score(batch).sum(-1)[4] != pytest.approx(scores.sum(-1)[4].item())


def test_retemplating_without_raw_prompt_names_the_fix(rm_module, toks):
    batch = rollout_batch(toks[0])
    del batch.non_tensor_batch["raw_prompt"]
    with pytest.raises(KeyError, match="return_raw_chat"):
        worker(rm_module, toks).compute_rm_score(batch)


# ---------------------------------------------------------------------------------------------- combination
class RuleReward:
    """1.0 on rows 0 and 3 (correct arithmetic), 0 elsewhere, on the last response token; counts calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        scores = torch.zeros(batch["responses"].shape)
        lengths = batch["response_mask"].sum(-1)
        for i in (0, 3):
            scores[i, int(lengths[i]) - 1] = 1.0
        return scores, {"acc": np.array([1.0, 0, 0, 1.0, 0])}


def test_replace_returns_the_reward_models_scores_and_skips_the_rule(rm_module, toks):
    """verl: with rm_scores in the batch the reward manager returns them; compute_score is not called."""
    batch, rule = rollout_batch(toks[0]), RuleReward()
    group = LocalWorkerGroup(None, rm=worker(rm_module, toks))
    scores, extra = score_responses(batch, rule, group, "replace")
    rm_scores = group.compute_rm_score(batch)
    torch.testing.assert_close(scores, rm_scores)
    assert rule.calls == 0 and set(extra) == {RM_SCORE_KEY}
    np.testing.assert_allclose(extra[RM_SCORE_KEY], rm_scores.sum(-1).numpy(), rtol=0, atol=1e-6)


def test_sum_adds_rule_and_reward_model_scores_on_the_same_token(rm_module, toks):
    batch, rule = rollout_batch(toks[0]), RuleReward()
    group = LocalWorkerGroup(None, rm=worker(rm_module, toks))
    scores, extra = score_responses(batch, rule, group, "sum")
    rm = [direct_score(rm_module, toks[1], rm_text(c, r)) for c, r in zip(CHATS, RESPONSES)]
    want = [1.0 + rm[0], rm[1], rm[2], 1.0 + rm[3], rm[4]]  # rule 1 on rows 0 and 3
    lengths = batch["response_mask"].sum(-1)
    for i in range(len(CHATS)):
        assert scores[i, int(lengths[i]) - 1].item() == pytest.approx(want[i], abs=1e-5)
        assert torch.count_nonzero(scores[i]) == 1
    assert rule.calls == 1 and "acc" in extra and RM_SCORE_KEY in extra


def test_without_a_reward_model_the_rule_reward_is_used():
    rule = RuleReward()
    batch = rollout_batch(build_tiny_tokenizer())
    scores, _ = score_responses(batch, rule, LocalWorkerGroup(None), "replace")
    assert rule.calls == 1 and scores.sum().item() == 2.0


def test_validation_is_skipped_for_model_style_rows_as_verl_does():
    batch = rollout_batch(build_tiny_tokenizer())
    assert validation_skip_reason(True, [batch]) is None  # style=rule: validated with the rule reward
    batch.non_tensor_batch["reward_model"][0] = {"style": "model", "ground_truth": "x"}
    assert "style=model" in validation_skip_reason(True, [batch])
    assert validation_skip_reason(False, [batch]) is None


# ---------------------------------------------------------------------------------------------- end to end
def rm_overrides(tmp_path, *extra):
    return ["algorithm.adv_estimator=gae", "reward_model.enable=True",
            f"reward_model.model.path={tiny_reward_model_dir(tmp_path)}", "reward_model.micro_batch_size_per_gpu=3",
            "reward_model.model.fsdp_config.mixed_precision.param_dtype=fp32", *extra]


def test_tiny_ppo_with_actor_critic_and_reward_model(tmp_path):
    from posttrain.trainer.trainer import RLTrainer

    trainer = RLTrainer(tiny_config(tmp_path, rm_overrides(tmp_path, "trainer.total_training_steps=2",
                                                           "trainer.val_before_train=True")))
    assert trainer.workers.has_rm and trainer.workers.has_critic
    history = trainer.fit()
    assert [row["step"] for row in history] == [0, 1, 2]
    assert any(k.startswith("val-core/") for k in history[0])  # validation: the rule-based reward
    for row in history[1:]:
        # replace (verl): the scores the critic and advantages see are the reward model's
        assert row["critic/score/mean"] == pytest.approx(row["reward_model/score/mean"], abs=1e-6)
        assert row["reward_model/score/mean"] != 0 and np.isfinite(row["critic/vf_loss"])
    batch = trainer.last_batch
    direct = trainer.workers.rm.compute_rm_score(batch)
    torch.testing.assert_close(batch["token_level_scores"], direct)


# ---------------------------------------------------------------------------------------------- start-up errors
def start(tmp_path, *extra):
    from posttrain.trainer.trainer import RLTrainer

    return RLTrainer(tiny_config(tmp_path, rm_overrides(tmp_path, *extra)))


def test_missing_reward_model_path_fails_at_start_up(tmp_path):
    with pytest.raises(ConfigError, match=r"reward_model\.model\.path=.*nowhere.* does not exist"):
        start(tmp_path, f"reward_model.model.path={tmp_path / 'nowhere'}")


def test_a_causal_lm_folder_is_refused_naming_the_key_and_what_is_valid(tmp_path):
    with pytest.raises(ConfigError) as err:
        start(tmp_path, f"reward_model.model.path={tiny_model_dir(tmp_path)}")
    text = str(err.value)
    assert "reward_model.model.path=" in text and "LlamaForCausalLM" in text and "ForSequenceClassification" in text


def test_a_multi_label_classifier_is_refused(tmp_path):
    path = tiny_reward_model_dir(tmp_path, num_labels=2, name="two_labels")
    with pytest.raises(ConfigError, match=r"reward_model\.model\.path=.*num_labels=2"):
        start(tmp_path, f"reward_model.model.path={path}")


def test_a_reward_model_without_tokenizer_files_is_refused(tmp_path):
    path = tiny_reward_model_dir(tmp_path, with_tokenizer=False, name="no_tokenizer")
    with pytest.raises(ConfigError, match=r"reward_model\.model\.path=.*cannot load its tokenizer"):
        start(tmp_path, f"reward_model.model.path={path}")


def test_a_bad_input_tokenizer_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"reward_model\.model\.input_tokenizer=.*does not exist"):
        start(tmp_path, f"reward_model.model.input_tokenizer={tmp_path / 'no_tokenizer_here'}")


@pytest.mark.parametrize("setting, message", [
    ("reward_model.micro_batch_size_per_gpu=0", r"reward_model\.micro_batch_size_per_gpu=0 must be >= 1"),
    ("reward_model.micro_batch_size_per_gpu=null", r"needs reward_model\.micro_batch_size_per_gpu"),
    ("reward_model.micro_batch_size=4", r"reward_model\.micro_batch_size=4 and .* both set"),
    ("reward_model.combine=mean", r"reward_model\.combine='mean' is not one of: replace, sum"),
])
def test_bad_reward_model_settings_are_config_errors(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, rm_overrides(tmp_path, setting))


def test_param_offload_pages_the_weights_on_cpu(toks, tmp_path, monkeypatch):
    """``reward_model.model.fsdp_config.param_offload`` on a CPU run: weights in a file (posttrain.host.paging),
    paged out after each scoring; the scores are the same."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if paging._filesystem_type(str(tmp_path)) in paging.IN_MEMORY_FILESYSTEMS:
        pytest.skip("the test folder is in memory (tmpfs): paging is refused there")
    batch = rollout_batch(toks[0])
    want = worker(tiny_reward_model(toks[1]), toks).compute_rm_score(batch)
    config = rm_config()
    config.model.fsdp_config.param_offload = True
    place = InProcess("cpu")  # the one-process placement pages the weights, and drops them after each call
    placed = place.shard(tiny_reward_model(toks[1]), config.model.fsdp_config, "fp32", forward_only=True,
                         fsdp_section="reward_model.model")
    paged = RewardModelWorker(placed, config, rm_tokenizer=toks[1], input_tokenizer=toks[0],
                              micro_batch_size=config.micro_batch_size_per_gpu)
    pages = paging.paged_weights(paged.module)
    assert pages is not None and paging.paged_weights(worker(tiny_reward_model(toks[1]), toks).module) is None
    assert {p.data_ptr() for p in paged.module.parameters()} <= {t.data_ptr() for t in pages.tensors}
    with place.resident(paged, phase="reward"):
        assert torch.equal(paged.compute_rm_score(batch), want)
    with place.resident(paged, phase="reward"):
        assert torch.equal(paged.compute_rm_score(batch), want)  # again, after the pages left
