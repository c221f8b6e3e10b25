"""End-of-run summary: before/after validation accuracy on the console and a reward/accuracy
curve (PNG) in the run folder."""

from __future__ import annotations

from pathlib import Path

from posttrain.trainer import setup


def _val_points(history: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for row in history:
        for key, value in row.items():
            if key.startswith("val-core/") or (key.startswith("val-aux/") and "acc/" in key):
                out.setdefault(key, []).append((row["step"], value))
    return out


def with_first_validation(history: list[dict], first_validation: dict | None) -> list[dict]:
    """``history`` starting with the run's step-0 validation: a resumed run's history starts after its
    checkpoint, but its gain is measured from the validation before the first step (kept in checkpoints)."""
    if not first_validation or (history and history[0]["step"] == 0):
        return history
    return [{"step": 0, **first_validation}, *history]


def summarize_run(trainer, history: list[dict]) -> None:
    run_dir = setup.run_dir(trainer.config)
    history = with_first_validation(history, trainer.first_validation)
    vals = _val_points(history)
    for key, points in vals.items():
        if len(points) >= 2:
            (s0, v0), (s1, v1) = points[0], points[-1]
            print(f"{key}: {v0:.3f} at step {s0} -> {v1:.3f} at step {s1} ({(v1 - v0) * 100:+.1f} points)")
        elif points:
            print(f"{key}: {points[0][1]:.3f} at step {points[0][0]}")
    print(memory_line(trainer.memory.take_metrics()["memory/peak_resident_gb"], history))
    path = plot_curves(history, run_dir / "curves.png")
    if path:
        print(f"curves: {path}")
    print(f"run folder: {run_dir}")


def memory_line(peak_gb: float, history: list[dict]) -> str:
    """The run's peak resident memory, with the phase that held the most (per-step ``memory/*`` metrics)
    and, on Ray ranks, the largest rank's peak."""
    phases: dict[str, float] = {}
    for row in history:
        for key, gb in row.items():
            if key.startswith("memory/resident_gb/") and key != "memory/resident_gb/step":
                phases[key.rsplit("/", 1)[1]] = max(phases.get(key.rsplit("/", 1)[1], 0.0), gb)
    line = f"peak resident memory: {peak_gb:.2f} GB"
    if phases:
        top = max(phases, key=phases.get)
        line += f" (largest training phase: {top}, {phases[top]:.2f} GB)"
    ranks = [row["memory/ranks/peak_resident_gb"] for row in history if "memory/ranks/peak_resident_gb" in row]
    if ranks:
        line += f"; largest rank: {max(ranks):.2f} GB (the line above is the driver process)"
    return line


def plot_curves(history: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no curve plotted; pip install 'posttrain[plot]')")
        return None
    steps = [r["step"] for r in history if "critic/score/mean" in r]
    scores = [r["critic/score/mean"] for r in history if "critic/score/mean" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, scores, label="train reward (mean score)")
    for key, points in _val_points(history).items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key.replace("val-core/", "val ").replace("val-aux/", "val "))
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
