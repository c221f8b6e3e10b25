"""The pipeline samples -> `posttrain prep pairs` -> DPO on a tiny random model: the pairs the model's
own samples make train it (the DPO loss on them falls), and the trainer's IPO loss on one of them
equals a float64 hand computation from two plain forwards (per-token averaged log-ratios)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers.sft import tiny_common
from helpers.tiny_run import tiny_model_dir
from posttrain.commands import prep
from posttrain.data.arithmetic import write_arithmetic_parquet
from posttrain.data.schema import read_rows, write_rows

PARITY_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 2 == 0)
'''


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """Pairs from the tiny model's own samples of arithmetic prompts, scored by a parity rule."""
    root = tmp_path_factory.mktemp("dpo_pipeline")
    write_arithmetic_parquet(str(root / "data"), n_train=8, n_test=2, digits=1, ops=("+",), seed=0)
    (root / "parity.py").write_text(PARITY_REWARD)
    model = tiny_model_dir(root)
    pairs = root / "pairs.parquet"
    assert prep.main(["pairs", "--input", str(root / "data" / "train.parquet"), "--model", str(model), "--output",
                      str(pairs), "--n", "4", "--max-new-tokens", "6", "--reward-path", str(root / "parity.py"),
                      "--param-dtype", "fp32", "--seed", "1"]) == 0
    rows = read_rows(str(pairs))
    assert len(rows) >= 4
    return {"model": model, "pairs": pairs, "rows": rows}


def _trainer(tmp_path, sampled, files, extra):
    from posttrain.config.sft_load import load_dpo_config
    from posttrain.trainer.dpo_trainer import DPOTrainer

    overrides = tiny_common(tmp_path, [f"model.partial_pretrain={sampled['model']}", f"data.train_files={files}",
                                       f"data.val_files={files}", *extra])
    return DPOTrainer(load_dpo_config(overrides=overrides))


def test_dpo_on_the_models_own_pairs_lowers_their_loss(tmp_path, sampled):
    n = len(sampled["rows"])
    t = _trainer(tmp_path, sampled, sampled["pairs"], [f"data.train_batch_size={n}", "trainer.total_training_steps=6",
                                                       "trainer.test_freq=6", "optim.lr=3e-3", "dpo.beta=0.5"])
    assert len(t.train_data) == n  # every written pair passes the reader's checks
    before = t.validate()
    history = t.fit()
    assert math.isclose(before["eval_loss"], math.log(2), rel_tol=1e-9)  # policy == reference
    assert math.isclose(history[0]["loss"], math.log(2), rel_tol=1e-6)
    assert history[-1]["eval_loss"] < math.log(2) - 0.05 and history[-1]["eval_rewards/accuracies"] > 0.5
    assert history[-1]["loss"] < history[0]["loss"]


def _sequence_logp(module: torch.nn.Module, prompt: list[int], response: list[int]) -> float:
    """Summed log-prob of ``response`` after ``prompt``: one unpadded float64 forward, full-vocabulary softmax."""
    with torch.no_grad():
        logits = module(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()
    return float(logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).sum())


def test_ipo_on_one_pair_equals_a_float64_hand_computation(tmp_path, sampled):
    from transformers import AutoModelForCausalLM

    one = tmp_path / "one.parquet"
    write_rows(sampled["rows"][:1], str(one))
    beta = 0.5
    t = _trainer(tmp_path, sampled, one, ["data.train_batch_size=1", "data.micro_batch_size_per_gpu=1",
                                          "dpo.loss_type=ipo", f"dpo.beta={beta}", "optim.lr=1e-3"])
    first = t.train_step(t.train_loader.next_batch())
    assert math.isclose(first["loss"], (1 / (2 * beta)) ** 2, rel_tol=1e-6)  # policy == reference: h = 0
    policy = copy.deepcopy(t.workers.actor.module).double().eval()  # the weights the next step starts from
    evaluated = t.validate()
    second = t.train_step(t.train_loader.next_batch())
    t.workers.shutdown()

    reference = AutoModelForCausalLM.from_pretrained(sampled["model"], dtype=torch.float64).eval()
    pair = t.train_data.pairs[0]
    ratios = {}
    for name, response in (("chosen", pair.chosen_ids), ("rejected", pair.rejected_ids)):
        ratios[name] = (_sequence_logp(policy, pair.prompt_ids, response)
                        - _sequence_logp(reference, pair.prompt_ids, response), len(response))
    (chosen, n_chosen), (rejected, n_rejected) = ratios["chosen"], ratios["rejected"]
    expected = (chosen / n_chosen - rejected / n_rejected - 1 / (2 * beta)) ** 2
    assert math.isclose(second["loss"], expected, rel_tol=1e-4), (second["loss"], expected)
    assert math.isclose(evaluated["eval_loss"], expected, rel_tol=1e-4), (evaluated["eval_loss"], expected)
    assert math.isclose(evaluated["eval_rewards/chosen"], beta * chosen, rel_tol=1e-4, abs_tol=1e-6)
    # negative control: the same loss on summed log-ratios (no per-token average) is another number
    assert n_chosen > 1 and n_rejected > 1 and abs(chosen - rejected) > 1e-3
    summed = (chosen - rejected - 1 / (2 * beta)) ** 2
    assert not math.isclose(second["loss"], summed, rel_tol=1e-2), (second["loss"], summed)


SELF_PAIRS = ["data.arithmetic.digits=1", "data.arithmetic.n_train=16", "data.arithmetic.n_test=4",
              "data.self_pairs.prompts=12", "data.self_pairs.n=2", "data.self_pairs.max_new_tokens=6",
              "data.self_pairs.batch_size=6", "model.fsdp_config.mixed_precision.param_dtype=fp32",
              "trainer.total_training_steps=1", "trainer.logger=[console,file]"]


def test_dpo_without_pairs_builds_them_from_its_own_samples_once(tmp_path, monkeypatch, capsys):
    """`posttrain dpo` as the built-in run (data.train_files null): the model's own samples on the built-in
    task's prompts become its pairs (as examples/dpo_smollm2_arithmetic.sh builds them), it trains on them
    and exports; the pairs are cached, so the next run (or a resume) samples nothing and trains on the same."""
    from posttrain.commands import pairs
    from posttrain.trainer.fsdp_sft_trainer import dpo_cli

    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    # every other sample right (the tiny random model never is): each prompt has a correct and a wrong reply
    monkeypatch.setattr(pairs, "_scores", lambda scorer, out, key: [float(i % 2) for i in range(len(out))])
    first = tiny_common(tmp_path / "a", SELF_PAIRS)
    assert dpo_cli(["--no-heldout-eval", *first]) == 0
    out = capsys.readouterr().out
    assert "DPO pairs: sampling 2 replies to each of 12 prompts of the built-in task" in out
    written = [line for line in out.splitlines() if line.startswith("DPO pairs: wrote ")]
    assert len(written) == 1 and int(written[0].split()[3]) >= 8  # a batch of pairs at least
    assert (tmp_path / "a" / "ckpt" / "hf_model" / "config.json").exists()

    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled again")

    monkeypatch.setattr(pairs, "sample_pairs", no_sampling)
    model = next(k for k in first if k.startswith("model.partial_pretrain="))
    assert dpo_cli(["--no-heldout-eval", *tiny_common(tmp_path / "b", SELF_PAIRS), model]) == 0
    assert "(the model's own samples, drawn by an earlier run)" in capsys.readouterr().out


def test_a_missing_data_file_is_found_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """`posttrain dpo` evaluates the starting model on the held-out task before training: a missing pairs file
    is reported first, in one line, not after that evaluation."""
    from posttrain.cli import main as cli
    from posttrain.trainer import sft_launch

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the model was evaluated before the data was checked")

    monkeypatch.setattr(sft_launch, "heldout_accuracy", no_evaluation)
    missing = tmp_path / "pairs.parquet"
    assert cli(["dpo", *tiny_common(tmp_path), f"data.train_files={missing}"]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "error" in line] == [f"error: data.train_files: {missing} does not exist"]
