"""Every run keeps what it trained (issue 40): SFT and DPO validate and save at their last step whatever
trainer.test_freq / save_freq say (verl's SFT trainer) and export hf_model/; an RL run with
trainer.export_at_end (the built-in run) exports hf_model/ without keeping a checkpoint; each finished
run prints one line naming its model and how to use it; non-finite steps stop SFT/DPO with exit code 3
and a broken model is never exported; `posttrain export` on a folder with no checkpoint says so."""

from __future__ import annotations

import pytest
import torch

from helpers.sft import tiny_common, tiny_dpo_config, tiny_sft_config, tiny_sft_overrides
from helpers.tiny_run import one_thread, tiny_config, tiny_model_dir
from posttrain.trainer.run import NonFiniteError, NonFiniteGuard

NO_SAVES = ["trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1"]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def build(stage: str, folder, extra: list[str] = ()):
    if stage == "sft":
        from posttrain.trainer.sft_trainer import SFTTrainer

        return SFTTrainer(tiny_sft_config(folder, [*NO_SAVES, *extra]))
    from posttrain.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer(tiny_dpo_config(folder, [*NO_SAVES, *extra]))


def model_line(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("model: ")]


@pytest.mark.parametrize("stage, val_key", [("sft", "val/loss"), ("dpo", "eval_loss")])
def test_sft_and_dpo_validate_save_and_export_at_the_last_step(tmp_path, capsys, stage, val_key):
    trainer = build(stage, tmp_path)
    history = trainer.fit()
    assert [row["step"] for row in history] == [1, 2]
    assert val_key not in history[0] and val_key in history[1]  # test_freq=-1: only the last step validates
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_2"]  # save_freq=-1: the last only
    hf = ckpt / "hf_model"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    trained = trainer.workers.actor.module.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name].cpu()), name
    lines = model_line(capsys.readouterr().out)
    assert lines == [f"model: {hf} (Hugging Face folder) - evaluate it: posttrain eval --model {hf} | train on it: "
                     f"posttrain train actor_rollout_ref.model.path={hf}"]
    assert trainer.session.model_dir == hf
    # started again, the finished run says so in one line and exits 0 (its model is there), training nothing
    from posttrain.cli import main as cli

    overrides = tiny_sft_overrides(tmp_path, NO_SAVES) if stage == "sft" else None
    if stage == "sft":
        assert cli(["sft", *overrides]) == 0
    else:
        data = tmp_path / "pairs"
        assert cli(["dpo", "--no-heldout-eval", *tiny_common(tmp_path, NO_SAVES),
                    f"data.train_files={data / 'train.jsonl'}", f"data.val_files={data / 'test.jsonl'}"]) == 0
    captured = capsys.readouterr()
    assert f"this run already finished in trainer.default_local_dir={ckpt} (step 2, its model: {hf})" in captured.out
    assert "error" not in captured.err and "step 1" not in captured.out


def test_rl_export_at_end_keeps_the_model_but_no_checkpoint(tmp_path, capsys):
    from posttrain.trainer.trainer import RLTrainer

    ckpt = tmp_path / "ckpt"
    trainer = RLTrainer(tiny_config(tmp_path, ["trainer.total_training_steps=1", "trainer.export_at_end=True"]))
    trainer.fit()
    hf = ckpt / "hf_model"
    assert (hf / "config.json").exists() and len(model_line(capsys.readouterr().out)) == 1
    # no checkpoint, no scratch folder left; the record that the run finished
    assert sorted(p.name for p in ckpt.iterdir()) == ["finished_run.json", "hf_model"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    trained = trainer.workers.actor.module.state_dict()
    assert all(torch.equal(t, trained[n].cpu()) for n, t in model.state_dict().items())
    # the same run started again says it finished (before any model loads); start_over trains it afresh
    from posttrain.trainer.resume import RunFinished

    with pytest.raises(RunFinished, match=f"this run already finished in trainer.default_local_dir={ckpt} "
                                          rf"\(step 1, its model: {hf}\)"):
        RLTrainer(tiny_config(tmp_path, ["trainer.total_training_steps=1", "trainer.export_at_end=True"]))
    from posttrain.trainer.main_ppo import run

    capsys.readouterr()
    assert run(tiny_config(tmp_path, ["trainer.total_training_steps=1", "trainer.export_at_end=True"])) == 0
    captured = capsys.readouterr()  # one line, not an error: the model the command asked for is there
    assert captured.out.startswith("this run already finished") and len(captured.out.splitlines()) == 1
    assert "error" not in captured.err
    again = RLTrainer(tiny_config(tmp_path, ["trainer.total_training_steps=1", "trainer.export_at_end=True",
                                             "trainer.start_over=True"]))
    assert [row["step"] for row in again.fit()] == [1]
    capsys.readouterr()
    # `posttrain export` on that folder: no checkpoint was saved, and where the model is
    from posttrain.trainer.export import main as export

    assert export([str(ckpt), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint was saved here" in err and "trainer.save_freq=-1" in err and str(hf) in err


def test_rl_without_export_at_end_says_nothing_was_kept(tmp_path, capsys):
    from posttrain.trainer.trainer import RLTrainer

    RLTrainer(tiny_config(tmp_path, ["trainer.total_training_steps=1"])).fit()  # verl's way: save_freq=-1
    out = capsys.readouterr().out
    assert not model_line(out) and "the trained model was not kept: trainer.save_freq=-1" in out
    assert not (tmp_path / "ckpt" / "hf_model").exists()


def nan_model_dir(tmp_path):
    """The tiny model with one weight NaN: every loss it computes is NaN (a cause other than the lr)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = tiny_model_dir(tmp_path), tmp_path / "nan_model"
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "layers.0" in n and p.dim() == 2)[0, 0] = float("nan")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_non_finite_steps_stop_with_exit_code_3_and_nothing_exported(tmp_path, capsys, stage):
    from posttrain.cli import main as cli

    overrides = [f"model.partial_pretrain={nan_model_dir(tmp_path)}", "trainer.total_training_steps=5",
                 "trainer.save_freq=-1", "trainer.test_freq=-1"]
    if stage == "sft":
        args = ["sft", *tiny_sft_overrides(tmp_path, overrides)]
    else:
        config = tiny_dpo_config(tmp_path)  # writes the pairs
        args = ["dpo", "--no-heldout-eval", f"data.train_files={config.data.train_files}",
                *[o for o in tiny_sft_overrides(tmp_path, overrides) if not o.startswith(("data.", "+data."))],
                "data.max_length=256", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4"]
    assert cli(args) == NonFiniteError.exit_code == 3
    err = capsys.readouterr().err
    assert "step 3: 3 steps in a row had a non-finite loss or gradient" in err
    assert "trainer.max_consecutive_nonfinite=3" in err
    assert not (tmp_path / "ckpt" / "hf_model").exists() and not list((tmp_path / "ckpt").glob("global_step_*"))


def test_a_model_with_non_finite_weights_is_not_exported(tmp_path, capsys):
    """Weights broken at the last step (the losses were finite): the final export refuses them."""
    trainer = build("sft", tmp_path)
    save = trainer.session.save_checkpoint

    def save_broken():
        with torch.no_grad():
            next(iter(trainer.workers.actor.module.parameters())).fill_(float("inf"))
        return save()

    trainer.session.save_checkpoint = save_broken
    with pytest.raises(NonFiniteError, match="the final model was not exported: .* hold NaN or inf"):
        trainer.fit()
    assert (tmp_path / "ckpt" / "global_step_2").is_dir() and not (tmp_path / "ckpt" / "hf_model").exists()


def test_the_guard_counts_steps_in_a_row_only():
    guard = NonFiniteGuard(3, "hint")
    bad, skipped, good = {"train/loss": float("nan")}, {"train/loss": 1.0, "train/nonfinite_skipped": 1.0}, \
        {"train/loss": 1.0, "train/nonfinite_skipped": 0.0}
    for step, metrics in enumerate([bad, skipped, good, bad, skipped], start=1):
        guard(step, metrics)  # never 3 in a row: no error
    assert guard.streak == 2
    with pytest.raises(NonFiniteError, match="step 6: 3 steps in a row .* hint"):
        guard(6, {"train/grad_norm": float("inf")})


def test_sft_reports_held_out_accuracy_before_and_after(tmp_path, capsys):
    """`posttrain sft --heldout-eval`: the built-in task's greedy accuracy of the starting model and of the
    exported one, as `posttrain eval` measures them."""
    from posttrain.cli import main as cli
    from posttrain.trainer.evaluate import evaluate

    overrides = tiny_sft_overrides(tmp_path, ["trainer.total_training_steps=1"])
    assert cli(["sft", "--heldout-eval", *overrides]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("held-out accuracy")]
    results = [evaluate(str(m), batch_size=64) for m in (tiny_model_dir(tmp_path), tmp_path / "ckpt" / "hf_model")]
    before, after = (r["overall"] for r in results)
    # each figure names its metric: strict (the #### answer), then flexible (the last number in the reply)
    assert line.startswith(f"held-out accuracy (built-in arithmetic task, {before['n']} questions, greedy): "
                           f"strict (the #### answer) {before['accuracy']:.1%} at step 0 -> {after['accuracy']:.1%} "
                           "at step 1")
    flexible = [next(v["flexible_accuracy"] for v in r["per_source"].values()) for r in results]
    assert f"; flexible (the last number in the reply) {flexible[0]:.1%} -> {flexible[1]:.1%} " in line
    assert before["n"] == 128
    assert cli(["sft", "--no-heldout-eval", *overrides, "trainer.start_over=True"]) == 0  # control: no report
    assert "held-out accuracy" not in capsys.readouterr().out
