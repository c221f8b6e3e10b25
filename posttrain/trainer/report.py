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
    # no memory line here: the run's one memory figure, the process tree's peak, was printed as fit ended
    path = plot_curves(history, run_dir / "curves.png")
    if path:
        print(f"curves: {path}")
    print(f"run folder: {run_dir}")


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
