"""The SFT trainer: which tokens are trained (token by token), the loss against a float64 loop, a
tiny run that learns, exact resume across an epoch boundary, export, bad rows named by file and row."""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.objectives import SFT
from posttrain.config.sft import SFTDataConfig, SFTMultiTurnConfig
from posttrain.data.schema import DataError, write_rows
from posttrain.data.sft import SFTDataset
from helpers.sft import tiny_sft_config
from helpers.tokenizer import build_tiny_tokenizer

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id


def dataset(tmp_path: Path, rows: list[dict], **keys) -> SFTDataset:
    path = tmp_path / "rows.jsonl"
    write_rows(rows, str(path))
    return SFTDataset(str(path), TOK, replace(SFTDataConfig(), **keys))


def chars(ids) -> list[str]:
    return [TOK.decode([i]) for i in ids]


def test_single_turn_trains_the_answer_and_its_end_of_turn_token_only(tmp_path):
    ds = dataset(tmp_path, [{"question": "2+2?", "answer": "4"}])
    batch = ds.collate_fn([ds[0]])
    prompt = TOK.decode(batch["prompts"][0])
    assert prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"  # ends at the generation prompt
    assert chars(batch["responses"][0]) == ["4", "<|im_end|>"]
    assert batch["response_mask"][0].tolist() == [1, 1]  # the answer and EOS (verl #3562: EOS was not trained)
    # the trained positions are exactly the response: the last prompt token ("\n") is predicted by nothing trained
    full = batch["input_ids"][0][batch["attention_mask"][0].bool()]
    trained = full[-2:]
    assert trained.tolist() == [TOK.convert_tokens_to_ids("4"), EOS]
    assert batch["position_ids"][0, -1] == len(full) - 1


def test_multi_turn_trains_every_assistant_message_and_nothing_else(tmp_path):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "tool", "content": "t"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "dd"}]
    ds = dataset(tmp_path, [{"messages": messages}], multiturn=SFTMultiTurnConfig(enable=True))
    batch = ds.collate_fn([ds[0]])
    assert TOK.decode(batch["prompts"][0]) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
                                               "<|im_start|>assistant\n")
    response = chars(batch["responses"][0])
    mask = batch["response_mask"][0].tolist()
    trained = "".join(c for c, m in zip(response, mask) if m)
    assert trained == "b<|im_end|>dd<|im_end|>"
    # hand-built: b, EOS trained; the newline, the tool and user turns and the second generation prompt are not
    second = "\n<|im_start|>tool\nt<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
    expected = ["b", "<|im_end|>"] + list(second.replace("<|im_start|>", "\0").replace("<|im_end|>", "\1"))
    expected = [{"\0": "<|im_start|>", "\1": "<|im_end|>"}.get(c, c) for c in expected] + ["d", "d", "<|im_end|>"]
    assert response[:len(expected)] == expected
    assert mask[:len(expected)] == [1, 1] + [0] * (len(expected) - 5) + [1, 1, 1]
    assert "".join(response) == TOK.apply_chat_template(messages, tokenize=False)[len(TOK.decode(batch["prompts"][0])):].rstrip("\n")


def test_sft_loss_is_the_token_mean_nll_of_trained_tokens(tmp_path):
    """update_sft's loss = a float64 loop over the full sequences (before the step), and the accumulated
    gradient over 4 micro-batches equals one micro-batch of 8 (same weights after the step)."""
    from posttrain.trainer.sft_trainer import SFTTrainer

    results = []
    for micro in (8, 2):
        trainer = SFTTrainer(tiny_sft_config(tmp_path / f"m{micro}", [f"data.micro_batch_size_per_gpu={micro}",
                                                                       "trainer.total_training_steps=1"]))
        batch = trainer.train_loader.next_batch()
        model = trainer.workers.actor.module
        with torch.no_grad():
            model.lm_head.weight.mul_(30)  # far from uniform, so a one-token shift changes the loss
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits.double()
        logp = logits.log_softmax(-1)
        nll = count = 0.0
        p = batch["prompts"].shape[1]
        for row in range(len(batch)):
            for j in range(batch["responses"].shape[1]):
                if batch["response_mask"][row, j]:
                    nll -= float(logp[row, p + j - 1, batch["responses"][row, j]])  # token p+j predicted at p+j-1
                    count += 1
        metrics = trainer.workers.update_actor(batch, SFT())
        assert math.isclose(metrics["train/loss"], nll / count, rel_tol=1e-5)
        wrong = -float(sum(logp[r, p - 2 + j, batch["input_ids"][r, p - 1 + j]] for r in range(len(batch))
                           for j in range(batch["responses"].shape[1]) if batch["response_mask"][r, j])) / count
        assert not math.isclose(metrics["train/loss"], wrong, rel_tol=1e-3)  # negative control: shifted by one
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    # Adam's first step moves a weight by lr * g / (|g| + eps): where g is near eps, a different fp32
    # summation order (4 micro-batches vs 1, or another CPU's kernels) moves it by a visible fraction of
    # lr (seen: 2.6e-6 of lr 1e-3). 1% of lr still tells a missing or doubled micro-batch (a 2x or 0.5x g).
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-5, atol=1e-5)


def test_tiny_sft_run_lowers_the_validation_loss_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.trainer.sft_trainer import SFTTrainer

    trainer = SFTTrainer(tiny_sft_config(tmp_path, ["trainer.total_epochs=3", "trainer.test_freq=4",
                                                    "trainer.save_freq=12"]))
    before = trainer.validate()["val/loss"]
    history = trainer.fit()
    assert len(history) == 12 and history[-1]["train/epoch"] == 2
    assert history[-1]["val/loss"] < before - 0.5, (before, history[-1]["val/loss"])
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "global_step_12" / "actor").is_dir() and (ckpt / "latest_checkpointed_iteration.txt").exists()
    exported = AutoModelForCausalLM.from_pretrained(ckpt / "hf_model")  # an RL run's actor_rollout_ref.model.path
    for name, value in trainer.workers.actor.module.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/loss" in line for line in lines)
    from posttrain.trainer.export import main as export_main  # `posttrain export` on the SFT checkpoints

    assert export_main([str(ckpt), "--output", str(tmp_path / "exported")]) == 0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    torch.testing.assert_close(again.state_dict()["lm_head.weight"], exported.state_dict()["lm_head.weight"])
    # the export starts an RL run (GRPO, one step) as its actor_rollout_ref.model.path
    from helpers.tiny_run import tiny_config
    from posttrain.trainer.trainer import RLTrainer

    rl = RLTrainer(tiny_config(tmp_path / "rl", [f"actor_rollout_ref.model.path={ckpt / 'hf_model'}",
                                                 "trainer.total_training_steps=1"]))
    torch.testing.assert_close(rl.workers.actor.module.state_dict()["lm_head.weight"],
                               exported.state_dict()["lm_head.weight"])
    assert len(rl.fit()) == 1


def test_resume_at_an_epoch_boundary_trains_the_next_epoch_exactly(tmp_path):
    """A run stopped at the end of epoch 1 and resumed trains all of epoch 2 (verl #7401 trained 0 steps) and
    ends with the uninterrupted run's weights."""
    from posttrain.trainer.sft_trainer import SFTTrainer

    extra = ["trainer.total_epochs=2", "trainer.save_freq=100"]
    straight = SFTTrainer(tiny_sft_config(tmp_path / "straight", extra))
    straight.fit()
    stopped = SFTTrainer(tiny_sft_config(tmp_path / "stopped", extra))
    per_epoch = len(stopped.train_loader)
    step = stopped.train_step

    def stop_at_epoch_end(batch):
        out = step(batch)
        if stopped.global_step == per_epoch:  # the step in flight
            os.kill(os.getpid(), signal.SIGTERM)  # a SIGTERM arriving during the last step of epoch 1
        return out

    stopped.train_step = stop_at_epoch_end
    first = stopped.fit()
    assert len(first) == per_epoch and stopped.stopped_by == signal.SIGTERM
    assert (tmp_path / "stopped" / "ckpt" / f"global_step_{per_epoch}").is_dir()
    resumed = SFTTrainer(tiny_sft_config(tmp_path / "stopped", extra))
    second = resumed.fit()
    assert [row["step"] for row in second] == list(range(per_epoch + 1, 2 * per_epoch + 1))
    assert {row["train/epoch"] for row in second} == {1}
    want = straight.workers.actor.module.state_dict()
    for name, value in resumed.workers.actor.module.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0)
    for a, b in zip(second, straight.history[per_epoch:]):
        assert a["train/loss"] == b["train/loss"]


@pytest.mark.parametrize("row, message", [
    ({"question": "q"}, "no column 'answer'"),
    ({"question": "q", "answer": "  "}, "column 'answer' is empty"),
    ({"question": "q" * 300, "answer": "a"}, "is over data.max_length=256"),
])
def test_bad_rows_are_one_error_naming_file_row_and_column(tmp_path, row, message):
    rows = [{"question": "fine", "answer": "ok"}, row]
    with pytest.raises(DataError, match=message) as err:
        dataset(tmp_path, rows, max_length=256)
    assert f"{tmp_path / 'rows.jsonl'}: row 1" in str(err.value)


def test_truncation_right_keeps_the_prompt_and_cuts_the_answer(tmp_path):
    ds = dataset(tmp_path, [{"question": "q", "answer": "x" * 100}], max_length=50, truncation="right")
    ex = ds[0]
    assert len(ex.prompt) + len(ex.response) == 50 and ex.response[-1] != EOS


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_says_how_many_rows_were_cut_once(tmp_path, caplog, truncation):
    rows = [{"question": "q" * 10, "answer": "x" * 40}, {"question": "q", "answer": "a"},
            {"question": "q" * 12, "answer": "x" * 45}]  # ~20 tokens of template around each question
    dataset(tmp_path, rows, max_length=60, truncation=truncation)
    cut = [r for r in caplog.records if "cut " in r.getMessage()]
    assert len(cut) == 1 and cut[0].getMessage().startswith(
        f"cut 2 of 3 rows to data.max_length=60 tokens (data.truncation={truncation})")
    caplog.clear()
    dataset(tmp_path, rows[1:2], max_length=60, truncation=truncation)  # negative control: nothing cut, nothing said
    assert not [r for r in caplog.records if "cut " in r.getMessage()]


MULTI = SFTMultiTurnConfig(enable=True)


@pytest.mark.parametrize("messages, multiturn, message", [
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}], MULTI,
     r"column 'messages': message 1 \(assistant\): field 'content' must be text, got int 5"),
    ([{"role": "user", "content": {"text": "a"}}, {"role": "assistant", "content": "b"}], MULTI,
     r"message 0 \(user\): field 'content' must be text, got dict"),
    ([{"role": 1, "content": "a"}, {"role": "assistant", "content": "b"}], MULTI, r"message 0: field 'role' must be text"),
    ([{"role": "user", "content": 7}], SFTMultiTurnConfig(), r"column 'question': message 0 \(user\): field 'content'"),
])
def test_message_fields_that_are_not_text_name_file_row_message_and_field(tmp_path, messages, multiturn, message):
    good = {"question": "fine", "answer": "ok", "messages": [{"role": "user", "content": "a"},
                                                            {"role": "assistant", "content": "b"}]}
    bad = {**good, "messages": messages} if multiturn.enable else {**good, "question": messages}
    with pytest.raises(DataError, match=message) as err:
        dataset(tmp_path, [good, bad], multiturn=multiturn)
    assert f"{tmp_path / 'rows.jsonl'}: row 1" in str(err.value)


def test_a_tools_column_that_is_not_json_names_the_row(tmp_path):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(DataError, match=r"rows.jsonl: row 0: column 'tools' is not a JSON list .*JSONDecodeError"):
        dataset(tmp_path, [{"messages": messages, "tools": "[{oops"}], multiturn=MULTI)


def test_an_assistant_message_with_tool_calls_may_have_no_content(tmp_path):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "2"}, {"role": "assistant", "content": "b"}]
    ds = dataset(tmp_path, [{"messages": messages}], multiturn=MULTI)
    assert chars(ds[0].response)[-2:] == ["b", "<|im_end|>"]


def test_config_errors_name_the_key_before_anything_loads(tmp_path):
    from posttrain.config.sft_load import load_sft_config
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="did you mean data.max_length"):
        load_sft_config(overrides=["data.max_lenght=3"])
    from posttrain.config.sft_load import sft_notes

    notes = sft_notes(load_sft_config(overrides=["ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=1"]))
    assert len(notes) == 1 and "ulysses_sequence_parallel_size=2: no effect here" in notes[0]
    with pytest.raises(ConfigError, match="an RL key"):
        load_sft_config(overrides=["actor_rollout_ref.actor.optim.lr=1"])


def test_padding_free_forward_gives_the_same_step(tmp_path):
    """use_remove_padding packs a micro-batch's tokens into one row: the same loss and weights."""
    from posttrain.trainer.sft_trainer import SFTTrainer

    runs = []
    for packed in (False, True):
        trainer = SFTTrainer(tiny_sft_config(tmp_path / str(packed), [f"use_remove_padding={packed}",
                                                                       "trainer.total_training_steps=2"]))
        runs.append((trainer.fit(), trainer.workers.actor.module.state_dict()))
    (plain, plain_w), (packed, packed_w) = runs
    for a, b in zip(plain, packed):
        assert math.isclose(a["train/loss"], b["train/loss"], rel_tol=1e-5)
    for name, value in plain_w.items():
        torch.testing.assert_close(packed_w[name], value, rtol=1e-4, atol=1e-6)


def test_deprecated_micro_batch_size_is_rows_over_all_ranks():
    from posttrain.config.sft_load import load_sft_config

    config = load_sft_config(overrides=["data.micro_batch_size=8", "trainer.n_gpus_per_node=2"])
    assert config.data.micro_batch_size_per_gpu == 4


def test_plan_describes_the_run_without_loading_a_model(capsys):
    from posttrain.plan import main

    code = main(["dpo", "trainer.n_gpus_per_node=2", "data.train_batch_size=16", "model.lora_rank=8",
                 "data.micro_batch_size_per_gpu=4"])
    out = capsys.readouterr().out
    assert code == 0 and "16 pairs -> 8 per rank -> 2 micro-batch(es)" in out
    assert "adapters disabled (no second model)" in out
    assert main(["sft", "data.train_batch_size=7", "trainer.n_gpus_per_node=2"]) == 1
    assert "must be divisible by the ranks" in capsys.readouterr().out


def test_prepared_gsm8k_and_arithmetic_rows_are_sft_rows(tmp_path):
    """`posttrain prep gsm8k` rows read with verl's SFT keys (extra_info.question -> extra_info.answer), and
    `posttrain prep arithmetic-sft` rows with the RL prompt -> the worked answer."""
    from posttrain.data.prep import gsm8k_rows, main as prep_main
    from posttrain.data.schema import read_rows

    record = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}
    write_rows(gsm8k_rows([record], "train"), str(tmp_path / "gsm8k.parquet"))
    ds = SFTDataset(str(tmp_path / "gsm8k.parquet"), TOK, replace(
        SFTDataConfig(), prompt_key="extra_info", prompt_dict_keys=["question"], response_key="extra_info",
        response_dict_keys=["answer"]))
    assert TOK.decode(ds[0].response) == record["answer"] + "<|im_end|>"
    assert record["question"] in TOK.decode(ds[0].prompt)
    assert prep_main(["arithmetic-sft", "--output", str(tmp_path / "arith"), "--n-train", "4", "--n-test", "2",
                      "--digits", "1"]) == 0
    row = read_rows(str(tmp_path / "arith" / "train.parquet"))[0]
    a, b = row["extra_info"]["question"].removeprefix("What is ").removesuffix("?").split(" + ")
    assert row["extra_info"]["answer"] == f"{a} + {b} = {int(a) + int(b)}\n#### {int(a) + int(b)}"
    assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))  # still an RL / evaluation row


def test_command_line_errors_are_one_line_with_the_exit_code(tmp_path, capsys):
    from posttrain.cli import main
    from helpers.sft import tiny_sft_overrides

    assert main(["sft", "data.max_lenght=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "data.max_length" in err[0]
    write_rows([{"prompt": [{"role": "user", "content": "q"}], "extra_info": {"answer": "a" * 400}}],
               str(tmp_path / "long.jsonl"))
    overrides = tiny_sft_overrides(tmp_path, ["trainer.total_training_steps=1"])
    overrides = [o for o in overrides if not o.startswith("data.train_files")] + [f"data.train_files={tmp_path / 'long.jsonl'}"]
    capsys.readouterr()  # the tiny model's files were written: their progress lines are not the run's
    assert main(["sft", *overrides]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "it/s" not in line]  # model-loading bars
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / 'long.jsonl'}: row 0: 421 tokens")
    assert "data.max_length=256" in err[0]
