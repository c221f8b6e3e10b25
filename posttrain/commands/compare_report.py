"""What `posttrain compare` reports, read from each run's `metrics.jsonl` (the `file` logger).

Per config: held-out accuracy at each validation (mean and sample standard deviation over seeds),
samples (responses trained on) and training time to reach an accuracy, seconds per step by phase,
peak memory (the process tree's), tokens per second; the verdict on the final accuracies, where a difference no
larger than the spread across seeds (the larger of the two standard deviations) is within noise.
Training time is the sum of the runs' `timing_s/step`: it leaves out start-up, validations and saves,
which are the same work for both configs, and survives a resume.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from posttrain.errors import ConfigError

PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
_STRICT_ACC = re.compile(r"^val-(core|aux)/.+/acc/mean@\d+$")  # core where acc is the headline (verl)


def read_metrics(path: Path) -> dict[int, dict]:
    """{step: metrics} from a metrics.jsonl. Records of the same step are merged, later values winning: the
    run loop logs some metrics in a record of their own at a step (the run's peak memory at its end), and
    a resumed run redoes the steps after its last checkpoint. A torn last line (a killed run) is skipped."""
    rows: dict[int, dict] = {}
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    return rows


def accuracy_key(runs: list[dict[int, dict]], wanted: Optional[str]) -> str:
    """The held-out accuracy metric: `wanted`, else the strict accuracy (`val-core/<source>/acc/mean@N`),
    else the validation reward (`val-core/...`); the first in sorted order when there are several sources."""
    keys = sorted({k for rows in runs for row in rows.values() for k in row if k.startswith("val-")})
    if wanted:
        if wanted not in keys:
            raise ConfigError(f"--metric {wanted}: no run logged it; logged validation metrics: {', '.join(keys) or 'none'}")
        return wanted
    for pick in ([k for k in keys if _STRICT_ACC.match(k)], [k for k in keys if k.startswith("val-core/")], keys):
        if pick:
            return pick[0]
    raise ConfigError("no run logged a validation metric (val-...): compare needs trainer.test_freq > 0 "
                      "or trainer.val_before_train=True")


def _std(values: list[float]) -> Optional[float]:
    return statistics.stdev(values) if len(values) >= 2 else None


@dataclass
class SideSummary:
    name: str
    label: str
    seeds: list[int]
    steps: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    """Mean over seeds of the training time up to each validation."""
    acc_by_seed: list[list[float]] = field(default_factory=list)
    """[validation][seed]."""
    phases: dict[str, float] = field(default_factory=dict)
    """Mean seconds per step by phase."""
    step_s: float = 0.0
    peak_gb: Optional[float] = None
    tokens_per_s: Optional[float] = None
    wall_s: list[float] = field(default_factory=list)
    """Each seed's wall time as compare measured it (start-up, validations and saves included)."""

    @property
    def acc_mean(self) -> list[float]:
        return [statistics.fmean(v) for v in self.acc_by_seed]

    @property
    def acc_std(self) -> list[Optional[float]]:
        return [_std(v) for v in self.acc_by_seed]

    def gains(self) -> list[float]:
        """Each seed's final minus first held-out accuracy."""
        if len(self.acc_by_seed) < 2:
            return []
        return [last - first for first, last in zip(self.acc_by_seed[0], self.acc_by_seed[-1])]

    def reach(self, target: float) -> Optional[tuple[int, float]]:
        """(samples, training seconds) at the first validation whose mean accuracy is at least `target`."""
        for samples, seconds, acc in zip(self.samples, self.train_s, self.acc_mean):
            if acc >= target - 1e-12:
                return samples, seconds
        return None


def summarize(name: str, label: str, runs: dict[int, dict[int, dict]], key: str, samples_per_step: int,
              wall_s: list[float]) -> SideSummary:
    """One config's summary over its finished seeds ({seed: {step: metrics}})."""
    out = SideSummary(name, label, sorted(runs), wall_s=wall_s)
    if not runs:
        return out
    common = set.intersection(*({s for s, row in rows.items() if key in row} for rows in runs.values()))
    out.steps = sorted(common)
    out.samples = [s * samples_per_step for s in out.steps]
    out.acc_by_seed = [[runs[seed][s][key] for seed in out.seeds] for s in out.steps]
    per_seed_time = [_cumulative_step_time(runs[seed]) for seed in out.seeds]
    out.train_s = [statistics.fmean(t.get(s, 0.0) for t in per_seed_time) for s in out.steps]
    train_rows = [row for rows in runs.values() for s, row in rows.items() if s > 0 and "timing_s/step" in row]
    if train_rows:
        out.step_s = statistics.fmean(r["timing_s/step"] for r in train_rows)
        out.phases = {p: statistics.fmean(r.get(f"timing_s/{p}", 0.0) for r in train_rows)
                      for p in PHASES if any(f"timing_s/{p}" in r for r in train_rows)}
        out.peak_gb = _peak_gb(train_rows)
        tokens = sum(r.get("perf/total_num_tokens", 0.0) for r in train_rows)
        seconds = sum(r.get("perf/time_per_step", r["timing_s/step"]) for r in train_rows)
        out.tokens_per_s = tokens / seconds if tokens and seconds > 0 else None
    return out


def _peak_gb(rows: list[dict]) -> Optional[float]:
    """The runs' peak memory: their process trees' (`memory/tree_peak_gb`, the figure a run ends with: rollout
    workers, Ray ranks and reward workers counted); a run logged before that figure existed, its processes' own."""
    for keys in (("memory/tree_peak_gb",), ("memory/peak_resident_gb", "memory/ranks/peak_resident_gb")):
        peaks = [r[k] for r in rows for k in keys if k in r]
        if peaks:
            return max(peaks)
    return None


def _cumulative_step_time(rows: dict[int, dict]) -> dict[int, float]:
    total, out = 0.0, {0: 0.0}
    for step in sorted(rows):
        total += rows[step].get("timing_s/step", 0.0) if step > 0 else 0.0
        out[step] = total
    return out


@dataclass(frozen=True)
class Verdict:
    delta: float
    """B's final mean accuracy minus A's."""
    noise: Optional[float]
    """The larger of the two final standard deviations; None with one seed per config."""
    text: str


def verdict(a: SideSummary, b: SideSummary) -> Optional[Verdict]:
    """The final held-out accuracies compared against the spread across seeds."""
    if not a.acc_by_seed or not b.acc_by_seed:
        return None
    ma, mb = a.acc_mean[-1], b.acc_mean[-1]
    delta = mb - ma
    spreads = [s for s in (a.acc_std[-1], b.acc_std[-1]) if s is not None]
    head = (f"final held-out accuracy: {a.name} {_pct(ma)}, {b.name} {_pct(mb)} "
            f"({b.name} - {a.name} = {delta * 100:+.1f} points")
    if not spreads:
        return Verdict(delta, None, head + "); one seed per config, so no spread to judge noise by: use --seeds 3")
    noise = max(spreads)
    if abs(delta) <= noise:
        return Verdict(delta, noise, head + f", within noise: the spread across seeds is ±{noise * 100:.1f} points)")
    ahead, behind = (b, a) if delta > 0 else (a, b)
    return Verdict(delta, noise, head + f"): {ahead.name} ahead of {behind.name} by more than the spread across "
                                        f"seeds (±{noise * 100:.1f} points)")


def default_target(sides: list[SideSummary]) -> Optional[float]:
    """The highest mean accuracy every config reaches at some validation (so each has a samples-to figure)."""
    best = [max(s.acc_mean) for s in sides if s.acc_by_seed]
    return min(best) if len(best) == len(sides) and best else None


def _pct(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:.1f}%"


def _pm(mean: float, std: Optional[float]) -> str:
    return f"{mean * 100:.1f}" + (f" ± {std * 100:.1f}" if std is not None else "")


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def curve_table(sides: list[SideSummary], key: str) -> str:
    n = max((len(s.seeds) for s in sides), default=0)
    lines = [f"held-out accuracy ({key}), % mean ± std over seeds ({n} per config)", "",
             "| config | step | samples | training time | accuracy | per seed |", "|---|---|---|---|---|---|"]
    for s in sides:
        for i, step in enumerate(s.steps):
            seeds = " ".join(f"{v * 100:.1f}" for v in s.acc_by_seed[i])
            lines.append(f"| {s.name} | {step} | {s.samples[i]} | {_duration(s.train_s[i])} | "
                         f"{_pm(s.acc_mean[i], s.acc_std[i])} | {seeds} |")
    return "\n".join(lines)


def summary_table(sides: list[SideSummary], target: Optional[float]) -> str:
    reach_head = f"samples / training time to {_pct(target)}" if target is not None else "samples to target"
    phases = [p for p in PHASES if any(p in s.phases for s in sides)]
    lines = [f"| config | seeds | gain, points (min over seeds) | {reach_head} | s/step ({' / '.join(phases)}) | "
             "peak memory | tokens/s | wall time per run |", "|---|---|---|---|---|---|---|---|"]
    for s in sides:
        if not s.seeds:
            lines.append(f"| {s.name} | 0 | no finished run yet | - | - | - | - | - |")
            continue
        gains = s.gains()
        gain = f"{_pm(statistics.fmean(gains), _std(gains))} ({min(gains) * 100:+.1f})" if gains else "-"
        hit = s.reach(target) if target is not None else None
        reach = f"{hit[0]} / {_duration(hit[1])}" if hit else "not reached"
        split = " / ".join(f"{s.phases.get(p, 0.0):.2f}" for p in phases)
        peak = f"{s.peak_gb:.2f} GB" if s.peak_gb is not None else "-"
        tps = f"{s.tokens_per_s:.0f}" if s.tokens_per_s else "-"
        wall = _duration(statistics.fmean(s.wall_s)) if s.wall_s else "-"
        lines.append(f"| {s.name} | {len(s.seeds)} | {gain} | {reach} | {s.step_s:.2f} ({split}) | {peak} | {tps} | {wall} |")
    return "\n".join(lines)


def plot(sides: list[SideSummary], key: str, path: Path) -> Optional[Path]:
    """Held-out accuracy against samples and against training time, one line per config, mean ± std shaded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install 'posttrain[plot]')")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for s in sides:
        if not s.steps:
            continue
        mean = [m * 100 for m in s.acc_mean]
        std = [(d or 0.0) * 100 for d in s.acc_std]
        for ax, xs in ((axes[0], s.samples), (axes[1], [t / 60 for t in s.train_s])):
            line, = ax.plot(xs, mean, marker="o", label=f"{s.name} ({len(s.seeds)} seeds)")
            ax.fill_between(xs, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                            color=line.get_color(), alpha=0.2)
    axes[0].set_xlabel("training samples (responses)")
    axes[1].set_xlabel("training time (min, validations excluded)")
    axes[0].set_ylabel(f"held-out accuracy, % ({key.split('/')[-2] if '/' in key else key})")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("mean over seeds, ± one standard deviation shaded", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
