"""`posttrain compare A B`: the report's numbers against hand-computed ones (means, sample standard
deviations, gains, samples/time to an accuracy, the noise verdict with its positive and negative
controls), two tiny runs per config end to end, resume after a stop and after a failure, and the bad
inputs (different model, a failed run, --seeds 0).

The end-to-end runs are forked from a forkserver that imported torch and posttrain once (the module
`compare` runs, `posttrain.cli train ...`, called in the child), as tests/trainer/test_signals.py does.
"""

import json
import multiprocessing
import multiprocessing.forkserver
import os
import statistics
import sys
from pathlib import Path

import pytest

from posttrain.cli import main as cli
from posttrain.commands import compare as compare_cmd
from posttrain.commands.compare_report import SideSummary, read_metrics, summarize, verdict
from helpers.tiny_run import tiny_model_dir, tiny_overrides

ACC = "val-core/posttrain/arithmetic/acc/mean@1"  # verl: acc is the core field where the scorer reports it


# ---- the report's numbers, from metrics written by hand ----

def _rows(accs: dict[int, float], step_s: float, steps: int = 4) -> dict[int, dict]:
    """Steps 0..steps, each training step taking step_s seconds; validations at the steps in `accs`."""
    rows = {}
    for step in range(steps + 1):
        row = {"step": step}
        if step in accs:
            row[ACC] = accs[step]
        if step > 0:
            row.update({"timing_s/step": step_s, "timing_s/gen": step_s / 2, "perf/total_num_tokens": 100 * step_s,
                        "perf/time_per_step": step_s, "memory/peak_resident_gb": 1.0 + step / 10})
        rows[step] = row
    return rows


def test_summary_numbers_by_hand():
    runs = {1: _rows({0: 0.40, 2: 0.50, 4: 0.60}, 2.0), 2: _rows({0: 0.40, 2: 0.60, 4: 0.80}, 4.0)}
    s = summarize("ppo", "label", runs, ACC, samples_per_step=32, wall_s=[100.0, 140.0])
    assert s.steps == [0, 2, 4] and s.samples == [0, 64, 128]
    assert s.acc_mean == pytest.approx([0.40, 0.55, 0.70])
    # sample std of two values a, b: |a - b| / sqrt(2)
    assert s.acc_std[1] == pytest.approx(0.10 / 2 ** 0.5) and s.acc_std[2] == pytest.approx(0.20 / 2 ** 0.5)
    assert s.gains() == pytest.approx([0.20, 0.40])
    # steps take 2 s (seed 1) and 4 s (seed 2); the validations at steps 2 and 4 come after 4 and 8 s
    # (seed 1) and 8 and 16 s (seed 2): means 6 s and 12 s
    assert s.train_s == pytest.approx([0.0, 6.0, 12.0])
    assert s.reach(0.55) == (64, pytest.approx(6.0)) and s.reach(0.71) is None
    assert s.step_s == pytest.approx(3.0) and s.phases["gen"] == pytest.approx(1.5)
    assert s.peak_gb == pytest.approx(1.4)
    # where runs log their process tree's peak, that is the figure (rollout workers and ranks counted)
    for rows in runs.values():
        rows[3]["memory/tree_peak_gb"] = 3.25
    assert summarize("ppo", "label", runs, ACC, samples_per_step=32, wall_s=[]).peak_gb == pytest.approx(3.25)
    assert s.tokens_per_s == pytest.approx(100.0)  # 100 tokens per second of every step


def _side(name: str, finals: list[float]) -> SideSummary:
    s = SideSummary(name, name, list(range(1, len(finals) + 1)))
    s.steps, s.samples, s.train_s = [0, 1], [0, 8], [0.0, 1.0]
    s.acc_by_seed = [[0.4] * len(finals), finals]
    return s


def test_verdict_within_noise_and_beyond():
    # spread: stdev([0.5, 0.6, 0.7]) = 0.1; a difference of 0.05 is within it, 0.25 beyond it
    a = _side("grpo", [0.5, 0.6, 0.7])
    near = verdict(a, _side("ppo", [0.55, 0.65, 0.75]))
    assert near.delta == pytest.approx(0.05) and near.noise == pytest.approx(0.1)
    assert "within noise" in near.text and "ahead" not in near.text
    far = verdict(a, _side("ppo", [0.80, 0.85, 0.90]))
    assert far.delta == pytest.approx(0.25) and "ppo ahead of grpo" in far.text and "within noise" not in far.text
    behind = verdict(_side("ppo", [0.80, 0.85, 0.90]), a)
    assert behind.delta == pytest.approx(-0.25) and "ppo ahead of grpo" in behind.text
    one = verdict(_side("x", [0.5]), _side("y", [0.9]))
    assert one.noise is None and "no spread" in one.text


def test_metrics_reader_keeps_a_resumed_steps_last_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # step 2 redone after a resume (a: 2 -> 3), then a record of its own for the same step (peak memory)
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2, "v": 5}\n{"step": 2, "a": 3}\n{"step": 2, "m": 7}\n'
                    '{"step": 3, "a"')
    assert read_metrics(path) == {1: {"step": 1, "a": 1}, 2: {"step": 2, "a": 3, "v": 5, "m": 7}}


def test_progress_lines_from_a_runs_log_and_metrics(tmp_path):
    from posttrain.commands.compare_progress import RunProgress

    log, metrics = tmp_path / "train.log", tmp_path / "metrics.jsonl"
    log.write_text("step 1/9 [##..] 0:00:01 elapsed, ETA 0:00:08 | an earlier attempt's line\n")
    metrics.write_text(json.dumps({"step": 0, ACC: 0.25}) + "\n")
    lines = []
    progress = RunProgress("[1/2] A seed 1", tmp_path, None, emit=lines.append)
    progress.poll()
    assert lines == []  # nothing trained yet (step 0 is the validation before training)
    with log.open("a") as f:
        f.write("step 1/3 [######..............] 0:00:10 elapsed, ETA 0:00:20 | score/mean=0.5\n"
                "step 2/3 [#############.......] 0:00:21 elapsed, ETA 0:00:10 | score/mean=0.75 val-core/x=0.5\n"
                "step 3/3 [####################] 0:00:3")  # a line still being written
    with metrics.open("a") as f:
        for row in ({"step": 1, "critic/score/mean": 0.5}, {"step": 2, "critic/score/mean": 0.75, ACC: 0.5}):
            f.write(json.dumps(row) + "\n")
    progress.poll()  # two steps since the last read: a line each, the metric as of that step
    assert lines == [f"[1/2] A seed 1: step 1/3, 0:00:10 elapsed, ETA 0:00:20 | score 0.5 | {ACC} 0.25 (step 0)",
                     f"[1/2] A seed 1: step 2/3, 0:00:21 elapsed, ETA 0:00:10 | score 0.75 | {ACC} 0.5 (step 2)"]
    progress.poll()
    assert len(lines) == 2  # nothing new: no line
    # the run started over at step 0 (its earlier metrics.jsonl moved aside): its new steps are shown again
    metrics.rename(tmp_path / "earlier_metrics.jsonl")
    metrics.write_text(json.dumps({"step": 1, "critic/score/mean": 0.125}) + "\n")
    progress.poll()
    assert lines[-1] == ("[1/2] A seed 1: step 1/3, 0:00:10 elapsed, ETA 0:00:20 | score 0.125 | "
                         "held-out accuracy: not logged yet")
    with_metric = RunProgress("[2/2] B seed 1", tmp_path, "val-aux/y/mean@1", emit=lines.append)
    metrics.write_text(metrics.read_text() + json.dumps({"step": 2, "critic/score/mean": 0.75}) + "\n")
    with_metric._shown = 1
    with_metric.poll()
    assert lines[-1] == "[2/2] B seed 1: step 2 | score 0.75 | val-aux/y/mean@1: not logged yet"


# ---- tiny runs end to end ----

def _run_module(argv: list[str], log: str) -> None:
    """`python -m ARGV` in a forked child: stdout/stderr to the log, exits with the command's code."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import torch

    torch.set_num_threads(1)
    module, args = argv[0], list(argv[1:])
    try:
        if module == "posttrain.cli":
            from posttrain.cli import main
        else:
            from posttrain.trainer.main_ppo import main
        code = main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkLauncher:
    """Runs each run forked from a preloaded forkserver; records what it ran; `script` can replace a
    run's outcome ({(side folder name, seed): list of actions}: "fail" writes an error line and
    returns 1 without running; "stop" runs it, then returns 143 as a SIGTERM'd run would)."""

    def __init__(self, ctx, script=None):
        self.ctx, self.script, self.ran = ctx, dict(script or {}), []

    def __call__(self, argv: list[str], log: Path) -> int:
        run = (log.parent.parent.name, int(log.parent.name.removeprefix("seed")))
        self.ran.append(run)
        action = self.script.get(run, []).pop(0) if self.script.get(run) else None
        if action == "fail":
            log.write_text("error: injected failure for the test\n")
            return 1
        proc = self.ctx.Process(target=_run_module, args=(argv, str(log)))
        proc.start()
        proc.join()
        return 143 if action == "stop" else proc.exitcode


@pytest.fixture(scope="module")
def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["posttrain.trainer.trainer", "posttrain.trainer.main_ppo", "posttrain.cli", "transformers"])
    multiprocessing.forkserver.ensure_running()
    return ctx


def _common(tmp_path: Path) -> list[str]:
    """The tiny run's keys, with a validation after every step; the estimator left to A and B."""
    return [o for o in tiny_overrides(tmp_path, ["trainer.test_freq=1", "trainer.val_before_train=True",
                                                  "trainer.total_training_steps=2"]) if "adv_estimator" not in o]


def test_two_tiny_configs_end_to_end_then_resumed(tmp_path, forkserver, capsys):
    out = tmp_path / "cmp"
    args = ["algorithm.adv_estimator=grpo", "algorithm.adv_estimator=rloo", "--seeds", "2", "--out", str(out),
            "--names", "grpo,rloo", *_common(tmp_path)]
    launch = ForkLauncher(forkserver, {("rloo", 1): ["stop"]})
    assert compare_cmd.main(args, launch=launch) == 143  # the stop ends the call after grpo seed 1, rloo seed 1
    assert launch.ran == [("grpo", 1), ("rloo", 1)]
    first = capsys.readouterr()
    assert "algorithm.adv_estimator: grpo -> rloo" in first.out  # the diff comes first
    assert "stopped: run the same command to resume" in first.err

    again = ForkLauncher(forkserver)
    assert compare_cmd.main(args, launch=again) == 0
    assert again.ran == [("rloo", 1), ("grpo", 2), ("rloo", 2)]  # grpo seed 1 finished earlier
    # the injected stop let that run finish: started again it says so and trains nothing (not from step 0)
    assert "this run already finished" in (out / "rloo" / "seed1" / "train.log").read_text()
    text = capsys.readouterr().out
    assert "[1/4] grpo seed 1: done (finished earlier)" in text
    # each run shows its steps as it trains: step i/N from its console line, the compared metric's latest value
    assert f"[3/4] grpo seed 2: step 1/2, " in text and f"[3/4] grpo seed 2: step 2/2, " in text
    last = [ln for ln in text.splitlines() if ln.startswith("[4/4] rloo seed 2: step 2/2")]
    rows = read_metrics(out / "rloo" / "seed2" / "metrics.jsonl")
    assert len(last) == 1 and f"| {ACC} {rows[2][ACC]:.3g} (step 2)" in last[0], text
    assert "[1/4] grpo seed 1: step" not in text  # a run finished earlier shows no steps again
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == ACC
    for name in ("grpo", "rloo"):
        side = summary["sides"][name]
        assert side["seeds"] == [1, 2] and side["steps"] == [0, 1, 2]
        assert side["samples"] == [0, 8, 16]  # 4 prompts x 2 responses a step
        per_seed = [read_metrics(out / name / f"seed{k}" / "metrics.jsonl") for k in (1, 2)]
        assert side["acc_mean"] == pytest.approx([statistics.fmean(r[s][ACC] for r in per_seed) for s in (0, 1, 2)])
        assert side["peak_gb"] > 0 and side["tokens_per_s"] > 0 and side["phases_s"]["gen"] > 0
        assert not list((out / name / "seed1" / "checkpoints").glob("global_step_*"))  # finished: only hf_model stays
    assert (out / "compare.png").stat().st_size > 10_000 and (out / "report.md").is_file()

    third = ForkLauncher(forkserver)  # everything finished: nothing runs, the report is the same
    assert compare_cmd.main(args, launch=third) == 0 and third.ran == []


@pytest.mark.slow  # four tiny runs; the verdict's arithmetic is tested by hand above
def test_identical_configs_are_within_noise(tmp_path, forkserver, capsys):
    # negative control: the same config twice, same seeds; whatever the runs' spread, a difference of 0
    out = tmp_path / "cmp"
    assert compare_cmd.main(["builtin", "builtin", "--seeds", "2", "--out", str(out), "--allow-same", *_common(tmp_path),
                             "algorithm.adv_estimator=grpo"], launch=ForkLauncher(forkserver)) == 0
    text = capsys.readouterr().out
    assert "0 keys differ" in text
    result = json.loads((out / "summary.json").read_text())["verdict"]
    assert result["delta"] == 0.0 and "within noise" in result["text"]


def test_a_failed_run_is_named_and_resumed_next_call(tmp_path, forkserver, capsys):
    out = tmp_path / "cmp"
    args = ["algorithm.adv_estimator=grpo", "algorithm.adv_estimator=rloo", "--out", str(out), *_common(tmp_path)]
    launch = ForkLauncher(forkserver, {("B", 1): ["fail"]})
    assert compare_cmd.main(args, launch=launch) == 1
    captured = capsys.readouterr()
    assert "error: B seed 1 failed (exit 1): error: injected failure for the test" in captured.err
    assert "A: algorithm.adv_estimator=grpo (1 of 1 seeds finished" in captured.out  # A's results kept
    assert "B: algorithm.adv_estimator=rloo (0 of 1 seeds finished" in captured.out
    again = ForkLauncher(forkserver)
    assert compare_cmd.main(args, launch=again) == 0 and again.ran == [("B", 1)]


# ---- bad input: one line each, nothing run ----

def _never(argv, log):
    raise AssertionError("no run should start")


def test_different_models_are_refused_unless_allowed(tmp_path, capsys):
    common = [o for o in _common(tmp_path) if not o.startswith("actor_rollout_ref.model.path=")]  # set per side
    one, other = tiny_model_dir(tmp_path, seed=0), tiny_model_dir(tmp_path, seed=1)
    args = [f"actor_rollout_ref.model.path={one}", f"actor_rollout_ref.model.path={other}",
            "--out", str(tmp_path / "cmp"), "algorithm.adv_estimator=grpo", *common]
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"A and B train different models or datasets \(actor_rollout_ref.model.path: "
                                          r".*tiny_model_0.* vs .*tiny_model_1.*\); pass --allow-different"):
        compare_cmd.main(args, launch=_never)
    capsys.readouterr()
    assert cli(["compare", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: A and B train different models or datasets")
    # negative control: with --allow-different the same pair is accepted (and, with --report-only, nothing runs)
    assert compare_cmd.main(args + ["--allow-different", "--report-only"], launch=_never) == 0
    assert "no finished runs to report yet" in capsys.readouterr().out


def _bad(args: list[str], capsys) -> str:
    """The CLI's one error line for `posttrain compare ARGS` (exit 2, nothing run)."""
    capsys.readouterr()
    assert cli(["compare", *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in captured.err, captured.err
    assert "keys differ" not in captured.out  # refused before the diff, so before any run
    return err[0]


def test_the_same_config_twice_is_refused_unless_allowed(tmp_path, capsys):
    common = [*_common(tmp_path), "--out", str(tmp_path / "cmp")]
    # the same resolved config, spelt differently: builtin's estimator is grpo; a seed and a name do not count
    line = _bad(["builtin", "algorithm.adv_estimator=grpo trainer.seed=7 trainer.experiment_name=x", *common], capsys)
    assert "are the same config" in line and "--allow-same" in line
    assert compare_cmd.main(["builtin", "builtin", "--allow-same", "--report-only", *common], launch=_never) == 0
    # negative control: one key that changes training is enough
    assert compare_cmd.main(["builtin", "actor_rollout_ref.rollout.temperature=0.9", "--report-only", *common],
                            launch=_never) == 0


def test_a_metric_that_is_not_a_validation_metric_is_refused_before_any_run(tmp_path, capsys):
    line = _bad(["algorithm.adv_estimator=grpo", "algorithm.adv_estimator=rloo", "--metric", "no/such/metric",
                 "--out", str(tmp_path / "cmp"), *_common(tmp_path)], capsys)
    assert line.startswith("error: --metric no/such/metric: compare reads a held-out validation metric")


def test_an_unlogged_metric_stops_after_the_first_run_naming_the_logged_ones(tmp_path, forkserver, capsys):
    out = tmp_path / "cmp"
    args = ["algorithm.adv_estimator=grpo", "algorithm.adv_estimator=rloo", "--metric", "val-core/no/such/mean@1",
            "--out", str(out), *_common(tmp_path)]
    launch = ForkLauncher(forkserver)
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--metric val-core/no/such/mean@1: A seed 1 did not log it; its validation "
                                          rf"metrics: .*{ACC}.*; the other runs were not started"):
        compare_cmd.main(args, launch=launch)
    assert launch.ran == [("A", 1)]
    # the next call finds it at once from the finished run, before starting B
    with pytest.raises(ConfigError, match="did not log it"):
        compare_cmd.main(args, launch=_never)


def test_an_out_path_that_is_a_file_is_refused(tmp_path, capsys):
    taken = tmp_path / "report.txt"
    taken.write_text("not a folder\n")
    args = ["algorithm.adv_estimator=grpo", "algorithm.adv_estimator=rloo", *_common(tmp_path)]
    line = _bad([*args, "--out", str(taken)], capsys)
    assert line == f"error: --out {taken}: {taken} is a file, so it cannot hold files; give a folder (created when missing)"
    below = _bad([*args, "--out", str(taken / "cmp")], capsys)  # a folder below a file
    assert f"{taken} (a folder above {taken / 'cmp'}) is a file" in below
    # negative control: a folder that does not exist yet is fine
    assert compare_cmd.main([*args, "--out", str(tmp_path / "new" / "cmp"), "--report-only"], launch=_never) == 0


def test_seeds_below_one_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli(["compare", "builtin", "builtin", "--seeds", "0"])
    assert stop.value.code == 2
    assert "argument --seeds: 0 is not valid: must be a whole number >= 1" in capsys.readouterr().err


def test_override_sets_land_on_the_builtin_run_and_at_file(tmp_path):
    listed = tmp_path / "ppo.txt"
    listed.write_text("# PPO\nalgorithm.adv_estimator=gae\nactor_rollout_ref.rollout.n=1\n")
    side = compare_cmd.build_side("B", f"@{listed}", ["data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=32"])
    assert side.config.algorithm.adv_estimator == "gae" and side.config.data.train_batch_size == 32
    # the built-in run's variant name (its own folders), not verl's default
    assert side.config.trainer.experiment_name == "arithmetic_gae_smollm2"
    assert side.argv[:2] == ("posttrain.cli", "train") and "algorithm.adv_estimator=gae" in side.argv
    assert compare_cmd.samples_per_step(side.config) == 32
