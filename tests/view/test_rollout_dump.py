"""Rollouts on disk (posttrain.trainer.rollout_dump / rollout_records): each field against the batch it came
from, groups kept together, the per-token and folder bounds, a failed write, multi-turn turns and calls, and
the built-in run's settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.tokenizer import build_tiny_tokenizer
from posttrain.batch import Batch
from posttrain.trainer.rollout_dump import INDEX, POINTER, RolloutDumps, SampleDump, describe
from posttrain.trainer.rollout_records import TokenText, batch_records, step_summary, trajectory_turns


def _batch(tok) -> Batch:
    """4 responses of 2 prompts, interleaved as a balanced batch may leave them (g1, g0, g1, g0); width 4,
    row 3 one token shorter."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = torch.tensor([[0] + enc("1+2"), enc("3+4="), [0] + enc("1+2"), enc("3+4=")])
    responses = torch.tensor([enc("#3ab"), enc("#7xy"), enc("#4cd"), enc("#7z") + [0]])
    resp_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    prompt_mask = (prompts != 0).long()
    lp = -torch.arange(16, dtype=torch.float32).reshape(4, 4) / 7  # -0, -0.142857..., ...
    scores = torch.zeros(4, 4)
    scores[[0, 1, 2, 3], [3, 3, 3, 2]] = torch.tensor([1.0, 1.0, 0.0, 1.0])
    return Batch.from_dict(
        {"prompts": prompts, "responses": responses, "response_mask": resp_mask,
         "attention_mask": torch.cat([prompt_mask, resp_mask], 1), "input_ids": torch.cat([prompts, responses], 1),
         "rollout_log_probs": lp, "old_log_probs": lp - 0.001, "ref_log_prob": lp - 0.5,
         "advantages": torch.tensor([[0.5] * 4, [-0.25] * 4, [-0.5] * 4, [0.25] * 4]) * resp_mask,
         "token_level_scores": scores, "token_level_rewards": scores - 0.125 * resp_mask},
        {"uid": np.array(["g1", "g0", "g1", "g0"], dtype=object),
         "data_source": np.array(["arith"] * 4, dtype=object),
         "reward_model": np.array([{"ground_truth": "3"}, {"ground_truth": "7"}] * 2, dtype=object)})


def test_records_hold_the_batch_numbers_groups_together():
    tok = build_tiny_tokenizer()
    batch = _batch(tok)
    extra = {"acc": np.array([1.0, 1.0, 0.0, 1.0])}
    recs = batch_records(batch, TokenText(tok), 5, extra=extra, entropy=torch.full((4, 4), 0.75))
    assert [(r["uid"], r["sample"]) for r in recs] == [("g1", 0), ("g1", 1), ("g0", 0), ("g0", 1)]  # rows 0, 2, 1, 3
    first, third = recs[0], recs[2]
    # verl's fields: input/output decoded without special tokens (the pad 0 dropped), summed score, ground truth
    assert (first["input"], first["output"], first["gts"], first["score"], first["step"]) == ("1+2", "#3ab", "3", 1.0, 5)
    assert first["acc"] == 1.0 and recs[1]["acc"] == 0.0 and first["data_source"] == "arith"
    assert first["reward"] == pytest.approx(1.0 - 4 * 0.125) and recs[3]["reward"] == pytest.approx(1.0 - 3 * 0.125)
    assert first["advantage"] == 0.5 and recs[3]["advantage"] == 0.25
    assert first["tokens"] == ["#", "3", "a", "b"] and first["ids"] == tok.encode("#3ab", add_special_tokens=False)
    # row 0's log-probs: -k/7 rounded to 4 places; old = rollout - 0.001; ref = rollout - 0.5
    assert first["logprobs"]["rollout"] == [0.0, -0.1429, -0.2857, -0.4286]
    assert first["logprobs"]["actor"] == [-0.001, -0.1439, -0.2867, -0.4296]
    assert first["logprobs"]["ref"] == [-0.5, -0.6429, -0.7857, -0.9286]
    assert first["entropy"] == [0.75] * 4 and "advantages" not in first  # the same on every token: one number
    assert third["input"] == "3+4=" and third["gts"] == "7"
    last = recs[3]  # row 3: 3 of its 4 positions written (the 4th is padding)
    assert last["tokens"] == ["#", "7", "z"] and last["response_length"] == 3 and "mask" not in last
    assert len(last["logprobs"]["rollout"]) == 3
    json.dumps(recs, allow_nan=False)  # plain JSON: no NaN


def test_per_token_values_only_on_the_first_whole_groups():
    tok = build_tiny_tokenizer()
    recs = batch_records(_batch(tok), TokenText(tok), 1, token_samples=3)
    assert ["tokens" in r for r in recs] == [True, True, False, False]  # group g1 fits 3, g0 would not
    assert recs[2]["output"] == "#7xy" and recs[2]["score"] == 1.0  # the text and numbers are still there
    recs = batch_records(_batch(tok), TokenText(tok), 1, token_samples=1)
    assert ["tokens" in r for r in recs] == [True, True, False, False]  # at least one whole group


def test_summary_counts_groups_and_finds_the_lowest_token():
    tok = build_tiny_tokenizer()
    recs = batch_records(_batch(tok), TokenText(tok), 1, extra={"acc": np.array([1.0, 1.0, 1.0, 1.0])})
    s = step_summary(recs)
    assert (s["samples"], s["groups"], s["token_samples"], s["all_right_groups"], s["all_wrong_groups"]) == (4, 2, 4, 2, 0)
    assert s["same_score_groups"] == 1  # g0: 1.0 and 1.0; g1: 1.0 and 0.0
    assert s["score_mean"] == 0.75
    # lowest actor log-prob: -(4 x row + token)/7 - 0.001 is lowest at row 3's last token (row 3 has 3):
    # -14/7 - 0.001, file position 3 (g0's second response)
    assert s["lowest"] == {"logprob": -2.001, "sample": 3, "token": 2}


def test_dump_writes_steps_index_pointer_and_keeps_its_bound(tmp_path, capsys):
    tok = build_tiny_tokenizer()
    dump = RolloutDumps(SampleDump(tmp_path / "rollouts", "train"), None, tok)
    metrics = dump.step(1, _batch(tok))
    assert set(metrics) == {"timing_s/dump_rollouts"}
    lines = (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()
    assert [json.loads(x)["uid"] for x in lines] == ["g1", "g1", "g0", "g0"]
    (entry,) = [json.loads(x) for x in (tmp_path / "rollouts" / INDEX).read_text().splitlines()]
    assert entry["step"] == 1 and entry["file"] == "1.jsonl" and entry["bytes"] == (tmp_path / "rollouts" / "1.jsonl").stat().st_size
    assert not list((tmp_path / "rollouts").glob(".*tmp"))  # written under a temporary name, then renamed
    # the folder's bound: step 2 would pass it -> indexed as not written, one line said once
    dump.train.max_bytes = dump.train.used + 100
    dump.step(2, _batch(tok))
    dump.step(3, _batch(tok))
    out = capsys.readouterr().out
    assert out.count("reached its bound") == 1 and "at step 2" in out
    entries = [json.loads(x) for x in (tmp_path / "rollouts" / INDEX).read_text().splitlines()]
    assert [(e["step"], e["file"]) for e in entries] == [(1, "1.jsonl"), (2, None), (3, None)]
    assert not (tmp_path / "rollouts" / "2.jsonl").exists() and "bound" in entries[1]["skipped"]


def test_a_failed_write_is_one_line_and_the_run_goes_on(tmp_path, capsys):
    tok = build_tiny_tokenizer()
    (tmp_path / "blocked").write_text("a file where the folder should be")
    dump = RolloutDumps(SampleDump(tmp_path / "blocked" / "rollouts", "train"), None, tok)
    dump.step(1, _batch(tok))
    dump.step(2, _batch(tok))  # no second message, no exception
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "rollouts on disk (step 1): cannot write" in out[0] and "the run goes on" in out[0]


def test_trajectory_turns_pair_calls_with_their_answers():
    tok = build_tiny_tokenizer()
    turns_text = [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+"}}</tool_call>'
         '<tool_call>{bad json}</tool_call>', 1),
        ("<|im_end|>\n<|im_start|>user\n<tool_response>\nError: cannot parse '2+' as arithmetic\n</tool_response>\n"
         "<tool_response>\nError: the call is not JSON\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>', 1),
        ("<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        ("#### 5", 1),
        ("<|im_end|>\n<|im_start|>user\ntry again<|im_end|>\n<|im_start|>assistant\n", 0),
    ]
    ids, mask = [], []
    for text, m in turns_text:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [m] * len(piece)
    turns = trajectory_turns(ids, mask, TokenText(tok).decode)
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant", "tool", "assistant", "user"]
    assert turns[0]["calls"] == [
        {"name": "calculator", "arguments": {"expression": "2+"}, "status": "error",
         "output": "Error: cannot parse '2+' as arithmetic"},
        {"name": "?", "arguments": "{bad json}", "status": "invalid", "output": "Error: the call is not JSON"}]
    assert turns[2]["calls"] == [{"name": "calculator", "arguments": {"expression": "2+3"}, "status": "ok", "output": "5"}]
    assert turns[4]["calls"] == [] and turns[1]["start"] == turns[0]["end"] and turns[-1]["end"] == len(ids)


def test_a_finished_run_wrote_every_step_as_its_batch(view_runs):
    run, batch = view_runs["A"], view_runs["A_last_batch"]
    index = [json.loads(x) for x in (run / "rollouts" / INDEX).read_text().splitlines()]
    assert [e["step"] for e in index] == [1, 2, 3] and all(e["samples"] == 16 for e in index)
    val = [json.loads(x)["step"] for x in (run / "validation" / INDEX).read_text().splitlines()]
    assert val == [0, 2, 3]  # before training, then trainer.test_freq=2 and the last step
    assert json.loads((run / POINTER).read_text())["rollout_data_dir"] == str((run / "rollouts").resolve())
    recs = [json.loads(x) for x in (run / "rollouts" / "3.jsonl").read_text().splitlines()]
    uids = list(batch.non_tensor_batch["uid"])
    for rec in recs:
        i = [k for k, u in enumerate(uids) if u == rec["uid"]][rec["sample"]]
        assert rec["score"] == pytest.approx(batch["token_level_scores"][i].sum().item(), abs=1e-6)
        n = rec["response_length"]
        assert rec["logprobs"]["actor"] == pytest.approx(batch["old_log_probs"][i, :n].tolist(), abs=5e-5)
        assert rec["logprobs"]["rollout"] == pytest.approx(batch["rollout_log_probs"][i, :n].tolist(), abs=5e-5)
        assert len(rec["entropy"]) == n and all(e > 0 for e in rec["entropy"])
        assert rec["advantage"] == pytest.approx(batch["advantages"][i, :n].mean().item(), abs=1e-5)
    by_group = {}
    for rec in recs:
        by_group.setdefault(rec["uid"], []).append(rec["score"])
    assert by_group["s3-p0"] == [1.0] * 4 and by_group["s3-p1"] == [0.0] * 4  # conftest's group_reward
    assert index[-1]["all_right_groups"] >= 1 and index[-1]["all_wrong_groups"] >= 1


def test_a_multi_turn_run_wrote_its_turns_calls_and_failures(view_runs):
    recs = [json.loads(x) for x in (view_runs["multi_turn"] / "rollouts" / "1.jsonl").read_text().splitlines()]
    rec = recs[0]
    assert [t["role"] for t in rec["turns"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    (failed,), (good,) = rec["turns"][0]["calls"], rec["turns"][2]["calls"]
    assert failed["status"] == "error" and failed["output"].startswith("Error:") and failed["arguments"] == {"expression": "1/0"}
    assert good == {"name": "calculator", "arguments": {"expression": "2+3"}, "status": "ok", "output": "5"}
    assert rec["multi_turn"]["tool_calls"] == 2 and rec["multi_turn"]["tool_errors"] == 1
    assert 0 in rec["mask"] and all(v is None for v, m in zip(rec["logprobs"]["rollout"], rec["mask"]) if not m)
    (entry,) = [json.loads(x) for x in (view_runs["multi_turn"] / "rollouts" / INDEX).read_text().splitlines()][:1]
    assert entry["tool_calls"] == 2 * len(recs) and entry["tool_errors"] == len(recs)


def test_the_builtin_run_writes_its_samples_into_its_run_folder_and_plan_says_so():
    from posttrain.config import BUILTIN_CONFIG, load_config

    config = load_config(base=BUILTIN_CONFIG)
    assert config.trainer.rollout_data_dir == "outputs/posttrain/arithmetic_grpo_smollm2/rollouts"
    assert config.trainer.validation_data_dir == "outputs/posttrain/arithmetic_grpo_smollm2/validation"
    moved = load_config(overrides=["trainer.run_dir=/tmp/elsewhere"], base=BUILTIN_CONFIG)
    assert moved.trainer.rollout_data_dir == "/tmp/elsewhere/rollouts"  # follows the run folder (compare sets it)
    text = describe(config, 15)
    # 32 responses x (4 x (256 + 24) + 300) + 32 x 24 x 45 bytes = 80,000 bytes = 78.1 KiB a step at most
    assert "32 responses a step, per-token log-probs for 32; up to ~78.1 KiB a step, up to 1.1 MiB for 15 steps" in text
    assert "64 responses a step, 1.0 GiB a folder" in text
    off = load_config(overrides=["trainer.rollout_data_dir=null", "trainer.validation_data_dir=null"], base=BUILTIN_CONFIG)
    assert describe(off, 10) is None  # verl's default: nothing written
