"""`posttrain compare A B [--seeds N] [key=value ...]`: run two configs on the same data and seeds and
report which learns more, faster, in less memory.

A and B are what `posttrain train`, `plan` and `diff` take: a verl launch script (verl's defaults under
it, as `python -m posttrain.trainer.main_ppo` runs it), a YAML config (`posttrain train --config`), or a
set of overrides, one quoted argument or `@file` (a file of key=value lines), applied to the built-in run
as `posttrain train key=value ...` does; `builtin` is the built-in run itself. key=value arguments after
A and B apply to both. The two configs' diff is printed, then N runs of each (seeds 1..N, A and B
alternating) run one after another, each in its own folder under the compare folder and each showing a
line per step as it trains (`compare_progress`), then the report (`compare_report`) is printed and
written there with the plot. Bad input (`check_inputs`) is refused before any run starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from posttrain.cli_args import positive_int, probability
from posttrain.commands import compare_report as report
from posttrain.commands.compare_progress import RunProgress
from posttrain.commands.compare_runs import Launcher, RunOutcome, RunSpec, run_keys, run_one, subprocess_launcher
from posttrain.config import BUILTIN_CONFIG
from posttrain.config.schema import PostTrainConfig
from posttrain.config.scripts import ConfigSource, load_source, parse_override_list, read_source
from posttrain.errors import ConfigError
from posttrain.host.disk import folder_problem

# What makes two runs train the same model on the same task; anything else may differ.
TASK_KEYS = ("actor_rollout_ref.model.path", "data.train_files", "data.val_files")
BUILTIN_TASK_KEYS = ("data.arithmetic.digits", "data.arithmetic.ops", "data.arithmetic.n_train",
                     "data.arithmetic.n_test", "data.arithmetic.seed", "data.arithmetic.prompt_style")
# Keys that only name, place or log a run, or that compare sets on every run itself (`run_keys`): two
# configs differing only in these train the same model the same way.
RUN_ONLY_KEYS = frozenset(("trainer.seed", "data.seed", "trainer.run_dir", "trainer.default_local_dir",
                           "trainer.resume_mode", "trainer.start_over", "trainer.logger", "trainer.project_name",
                           "trainer.experiment_name", "trainer.save_freq", "trainer.max_actor_ckpt_to_keep",
                           "trainer.max_critic_ckpt_to_keep"))
VALIDATION_PREFIXES = ("val-core/", "val-aux/")


@dataclass(frozen=True)
class Side:
    name: str
    source: ConfigSource
    config: PostTrainConfig
    """Resolved, with the common overrides, validated."""
    argv: tuple[str, ...]
    """`main_ppo` arguments giving this config (before the per-run keys)."""


def read_side(spec: str) -> ConfigSource:
    """A script or YAML as `read_source` reads it; an override set (inline, `@file`, or a file of key=value
    lines) and `builtin` on the built-in run, as `posttrain train` applies its overrides."""
    if spec == "builtin":
        return ConfigSource(spec, "overrides", base=BUILTIN_CONFIG)
    if spec.startswith("@"):
        path = Path(spec[1:]).expanduser()
        if not path.is_file():
            raise ConfigError(f"{spec}: no such file of key=value overrides")
        source = read_source(str(path))
        if source.kind != "overrides":
            raise ConfigError(f"{spec}: @ names a file of key=value lines; give a {source.kind} file without @")
    else:
        source = read_source(spec)
    if source.kind == "overrides":
        return ConfigSource(source.label, "overrides", overrides=source.overrides, base=BUILTIN_CONFIG)
    return source


def side_argv(source: ConfigSource) -> list[str]:
    """The module to run and its arguments, as this source is run on its own: `posttrain train` (the
    built-in run, or `--config YAML`) or `python -m posttrain.trainer.main_ppo` (a script, on verl's defaults)."""
    overrides = [item.text for item in source.overrides]
    if source.base is not None:
        return ["posttrain.cli", "train", *overrides]
    if source.yaml_path is not None:
        return ["posttrain.cli", "train", "--config", str(source.yaml_path), *overrides]
    return ["posttrain.trainer.main_ppo", *overrides]


def build_side(name: str, spec: str, common: list[str]) -> Side:
    source = read_side(spec)
    config = load_source(source, common, validate=True)
    if config.trainer.test_freq <= 0 and not config.trainer.val_before_train:
        raise ConfigError(f"{name} ({spec}) never validates (trainer.test_freq={config.trainer.test_freq}, "
                          "val_before_train=False): compare reads held-out accuracy from validations; set trainer.test_freq")
    return Side(name, source, config, tuple(side_argv(source) + common))


def _get(config: PostTrainConfig, key: str):
    from posttrain.config.validate import get_key

    return get_key(config, key)


def task_differences(a: Side, b: Side) -> list[str]:
    """`key: A's value vs B's value` for each model/data key that differs."""
    keys = list(TASK_KEYS)
    if a.config.data.train_files is None or b.config.data.train_files is None:
        keys += BUILTIN_TASK_KEYS
    return [f"{k}: {_get(a.config, k)!r} vs {_get(b.config, k)!r}" for k in keys if _get(a.config, k) != _get(b.config, k)]


def training_differences(a: Side, b: Side) -> list[str]:
    """The keys (outside `RUN_ONLY_KEYS`) whose resolved values differ between A and B."""
    from posttrain.diff import diff_keys

    return [d.key for d in diff_keys(a.config, b.config, {}, {}) if d.key not in RUN_ONLY_KEYS]


def check_inputs(a: Side, b: Side, args: argparse.Namespace, folder: Path) -> None:
    """The bad inputs found before any run starts: one error each (`ConfigError`)."""
    different = task_differences(a, b)
    if different and not args.allow_different:
        raise ConfigError(f"A and B train different models or datasets ({'; '.join(different)}); "
                          "pass --allow-different to compare them anyway")
    if not args.allow_same and not training_differences(a, b):
        raise ConfigError(f"A ({args.a}) and B ({args.b}) are the same config: after the common overrides no key "
                          "that changes training differs (run names, seeds, folders, loggers and save cadence do not "
                          "count), so the runs would repeat each other; give two different configs, or pass --allow-same for an "
                          "A/A control (the spread across seeds alone)")
    if args.metric is not None and not args.metric.startswith(VALIDATION_PREFIXES):
        raise ConfigError(f"--metric {args.metric}: compare reads a held-out validation metric, named "
                          "val-core/<data source>/<field>/<statistic> or val-aux/... (e.g. "
                          "val-core/posttrain/arithmetic/acc/mean@1); leave --metric out for the strict accuracy")
    problem = folder_problem(folder)
    if problem is not None:
        raise ConfigError(f"--out {folder}: {problem}; give a folder (created when missing)")


def check_metric_logged(metric: str | None, outcome: RunOutcome) -> None:
    """--metric against what a finished run logged: named at the first finished run, before the next starts."""
    if metric is None:
        return
    rows = report.read_metrics(outcome.spec.folder / "metrics.jsonl")
    logged = sorted({k for row in rows.values() for k in row if k.startswith(VALIDATION_PREFIXES)})
    if metric not in logged:
        raise ConfigError(f"--metric {metric}: {outcome.spec.side} seed {outcome.spec.seed} did not log it; its "
                          f"validation metrics: {', '.join(logged) or 'none'}; the other runs were not started: "
                          "run again with one of those")


def samples_per_step(config: PostTrainConfig) -> int:
    """Responses trained on per step."""
    return int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)


def _slug(source: ConfigSource) -> str:
    if source.kind in ("script", "yaml") or Path(source.label).is_file():
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(source.label).stem)[:40]
    return "builtin" if source.label == "builtin" else "overrides"


def default_folder(a: Side, b: Side) -> Path:
    """outputs/compare/<A>-vs-<B>-<hash of both commands>: the same command finds its runs again."""
    digest = hashlib.sha256(json.dumps([a.name, list(a.argv), b.name, list(b.argv)]).encode()).hexdigest()[:8]
    return Path("outputs") / "compare" / f"{_slug(a.source)}-vs-{_slug(b.source)}-{digest}"


def plan_runs(sides: list[Side], seeds: int, folder: Path) -> list[RunSpec]:
    """Seed by seed, A then B: an interrupted compare has both configs' first seeds before anything else."""
    runs = []
    for seed in range(1, seeds + 1):
        for side in sides:
            run_folder = (folder / side.name / f"seed{seed}").resolve()
            cfg = side.config.trainer
            save_freq = cfg.test_freq if cfg.test_freq > 0 else max(1, (cfg.total_training_steps or 3) // 3)
            runs.append(RunSpec(side.name, seed, run_folder,
                                side.argv + tuple(run_keys(run_folder, seed, cfg, save_freq))))
    return runs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="posttrain compare", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run two configs on the same data and seeds and report held-out accuracy (mean and spread over "
                    "seeds), samples and training time to an accuracy, step time by phase, peak memory and tokens/s, "
                    "with a plot; a difference no larger than the spread across seeds is reported as within noise.",
        epilog="A and B: a verl launch script (verl's defaults under it), a YAML config (as train --config), or "
               "overrides on the built-in run (as `posttrain train key=value ...`): one quoted argument, e.g.\n"
               "  posttrain compare 'algorithm.adv_estimator=gae actor_rollout_ref.rollout.n=1 data.train_batch_size=32' "
               "builtin --seeds 3\n"
               "or @FILE, a file of key=value lines (# comments); `builtin` is the built-in run. Runs go to "
               "--out/<name>/seed<k>/; the same command again skips finished runs and resumes the others from their "
               "checkpoints.")
    p.add_argument("a", help="config A: script, YAML, 'key=value ...', @file or builtin")
    p.add_argument("b", help="config B: the same kinds as A")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to both A and B (after their own keys)")
    p.add_argument("--seeds", type=positive_int, default=1, help="runs per config, seeds 1..N (default 1)")
    p.add_argument("--names", help="names of A and B in the report, comma-separated (default A,B)")
    p.add_argument("--out", help="compare folder (default outputs/compare/<A>-vs-<B>-<hash of the commands>)")
    p.add_argument("--allow-different", action="store_true", help="compare configs that train different models or datasets")
    p.add_argument("--allow-same", action="store_true",
                   help="compare a config with itself (an A/A control: the spread across seeds alone)")
    p.add_argument("--target", type=probability,
                   help="held-out accuracy (0-1] to report samples and time to (default: the highest both reach)")
    p.add_argument("--metric", help="validation metric to compare (default val-core/<source>/acc/mean@N)")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep finished runs' resumable checkpoints (default: only their final hf_model/ stays)")
    p.add_argument("--report-only", action="store_true", help="report the runs already finished; start none")
    return p


def _names(text: str | None) -> tuple[str, str]:
    if text is None:
        return "A", "B"
    names = [n.strip() for n in text.split(",")]
    if len(names) != 2 or not all(re.fullmatch(r"[A-Za-z0-9_.+-]+", n) for n in names) or names[0] == names[1]:
        raise ConfigError(f"--names {text!r}: give two different names of letters, digits, _ . + -, comma-separated")
    return names[0], names[1]


def main(argv: list[str] | None = None, launch: Launcher = subprocess_launcher) -> int:
    args = _parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    common = [item.text for item in parse_override_list(" ".join(_quote(o) for o in args.overrides))]
    names = _names(args.names)
    a, b = build_side(names[0], args.a, common), build_side(names[1], args.b, common)
    folder = Path(args.out) if args.out else default_folder(a, b)
    check_inputs(a, b, args, folder)
    _print_diff(a, b, common)
    outcomes = [] if args.report_only else run_all(plan_runs([a, b], args.seeds, folder), launch,
                                                   args.keep_checkpoints, args.metric)
    stopped = [o for o in outcomes if o.status == "stopped"]
    text = write_report([a, b], args.seeds, folder, args.target, args.metric)
    print(text)
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        print(f"error: {o.spec.side} seed {o.spec.seed} failed (exit {o.returncode}): {o.reason} "
              f"(log: {o.spec.folder / 'train.log'}); the other runs' results are kept: run the same command to resume it",
              file=sys.stderr)
    if stopped:
        print(f"stopped: run the same command to resume ({folder})", file=sys.stderr)
        return stopped[0].returncode if stopped[0].returncode > 0 else 130
    return 1 if failed else 0


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _print_diff(a: Side, b: Side, common: list[str]) -> None:
    from posttrain.diff import compare as diff_configs, render

    print(render(diff_configs(a.source, b.source, extra=common)), end="\n\n", flush=True)


def run_all(runs: list[RunSpec], launch: Launcher, keep_checkpoints: bool, metric: str | None = None) -> list[RunOutcome]:
    """Every run in order, each showing its steps as it trains (`RunProgress`); a failed run is reported and
    the others go on; a stopped one (Ctrl-C, SIGTERM) ends the call; a --metric the first finished run did
    not log ends it too (`check_metric_logged`)."""
    outcomes = []
    for i, spec in enumerate(runs, start=1):
        prefix = f"[{i}/{len(runs)}] {spec.side} seed {spec.seed}"
        print(f"{prefix}: {spec.folder}", flush=True)
        with RunProgress(prefix, spec.folder, metric):
            outcome = run_one(spec, launch, keep_checkpoints)
        note = {"done": f"done ({outcome.reason or f'{outcome.wall_s:.0f} s'})", "failed": f"FAILED: {outcome.reason}",
                "stopped": "stopped by a signal (its checkpoint resumes it)"}[outcome.status]
        print(f"{prefix}: {note}", flush=True)
        outcomes.append(outcome)
        if outcome.status == "stopped":
            break
        if outcome.status == "done":
            check_metric_logged(metric, outcome)
    return outcomes


def _finished(folder: Path, side: str, seeds: int) -> tuple[dict[int, dict[int, dict]], list[float]]:
    """{seed: metrics by step} of the side's finished runs, and their wall times."""
    from posttrain.commands.compare_runs import read_record

    runs, walls = {}, []
    for seed in range(1, seeds + 1):
        run = folder.resolve() / side / f"seed{seed}"
        record = read_record(run)
        if record and record.get("done"):
            runs[seed] = report.read_metrics(run / "metrics.jsonl")
            walls.append(sum(a.get("wall_s", 0.0) for a in record.get("attempts", [])))
    return runs, walls


def write_report(sides: list[Side], seeds: int, folder: Path, target: float | None, metric: str | None) -> str:
    """The report's text (also written to report.md and summary.json in the folder) and the plot."""
    finished = {s.name: _finished(folder, s.name, seeds) for s in sides}
    if not any(runs for runs, _ in finished.values()):
        return "no finished runs to report yet"
    key = report.accuracy_key([r for runs, _ in finished.values() for r in runs.values()], metric)
    summaries = [report.summarize(s.name, s.source.label, finished[s.name][0], key, samples_per_step(s.config),
                                  finished[s.name][1]) for s in sides]
    target = target if target is not None else report.default_target(summaries)
    verdict = report.verdict(*summaries)
    path = report.plot(summaries, key, folder / "compare.png")
    lines = [f"{side.name}: {side.source.label} ({len(s.seeds)} of {seeds} seeds finished; "
             f"{samples_per_step(side.config)} samples per step)" for side, s in zip(sides, summaries)]
    lines += ["", report.curve_table(summaries, key), "", report.summary_table(summaries, target), ""]
    lines += [verdict.text if verdict else "no verdict: a config has no finished run"]
    lines += [f"plot: {path}" if path else "plot: none", f"runs: {folder}"]
    text = "\n".join(lines)
    (folder / "report.md").write_text(text + "\n", encoding="utf-8")
    (folder / "summary.json").write_text(json.dumps(_summary_json(summaries, key, target, verdict), indent=1),
                                         encoding="utf-8")
    return text


def _summary_json(summaries: list[report.SideSummary], key: str, target, verdict) -> dict:
    sides = {s.name: {"label": s.label, "seeds": s.seeds, "steps": s.steps, "samples": s.samples,
                      "train_s": s.train_s, "acc_by_seed": s.acc_by_seed, "acc_mean": s.acc_mean, "acc_std": s.acc_std,
                      "gains": s.gains(), "reach": s.reach(target) if target is not None else None,
                      "phases_s": s.phases, "step_s": s.step_s, "peak_gb": s.peak_gb, "tokens_per_s": s.tokens_per_s,
                      "wall_s": s.wall_s} for s in summaries}
    return {"metric": key, "target": target, "sides": sides,
            "verdict": None if verdict is None else {"delta": verdict.delta, "noise": verdict.noise, "text": verdict.text}}
