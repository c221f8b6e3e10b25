"""Metric back ends behind one `Tracking` object: console, file (JSON lines), tensorboard, wandb, mlflow.

`trainer.logger` names the back ends. Optional ones are imported at start-up so a missing
package fails before any model loads, with the extra to install named.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from posttrain.config import ConfigError

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def finish(self) -> None: ...


def _require(module: str, backend: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"trainer.logger includes {backend!r} but the {module!r} package is not installed; "
            f"install it with: pip install 'posttrain[{EXTRAS[backend]}]'"
        ) from None


class ConsoleBackend:
    """One readable line per step, with the headline metrics first, plus elapsed time and ETA."""

    # Each shown where the run logs it, so a line carries what matters for its kind of run.
    # rollout_actor_probs_diff_mean: mean |p_rollout - p_actor| of the sampled tokens, the engine/trainer
    # mismatch (a bf16 vLLM engine shows it; a growing value means the rollout is drifting off-policy).
    # tool_call_rate: multi-turn runs with tools, the share of responses that called one. samples_per_s and
    # the idle ratios: the async run (a rollout pool beside the trainer). tree_peak_gb: the run's one memory
    # figure, its process tree's peak so far (rollout workers, Ray ranks and reward workers counted).
    HEADLINE = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss",
                "response_length/mean", "multi_turn/tool_call_rate/mean", "training/rollout_actor_probs_diff_mean",
                "train/loss", "val/loss", "loss", "rewards/margins", "rewards/accuracies", "eval_rewards/accuracies",
                "timing_s/step", "perf/throughput", "perf/samples_per_s", "trainer/idle_ratio", "rollouter/idle_ratio",
                "memory/tree_peak_gb")

    def __init__(self, total_steps: int | None):
        self.total, self.start = total_steps, time.monotonic()
        self.first_step: int | None = None  # the first step this process trained (a resumed run's is not 1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = [k for k in self.HEADLINE if k in metrics] + sorted(k for k in metrics if k.startswith("val-core/"))
        names = column_names(shown)
        parts = [f"{names[k]}={_fmt(metrics[k])}" for k in shown]
        print(f"step {step}{self._progress(step)} | " + " ".join(parts), flush=True)

    def _progress(self, step: int) -> str:
        if not self.total or step <= 0:
            return ""
        elapsed = time.monotonic() - self.start
        if self.first_step is None:
            self.first_step = step
        done_here = step - self.first_step + 1  # the ETA's pace: this process's steps, not the resumed ones
        eta = elapsed / done_here * max(self.total - step, 0)
        width = 20
        filled = int(width * min(step / self.total, 1.0))
        return f"/{self.total} [{'#' * filled}{'.' * (width - filled)}] {_hms(elapsed)} elapsed, ETA {_hms(eta)}"

    def finish(self) -> None:
        pass


@dataclass(frozen=True)
class StepProgress:
    """Where a run stands, as its console line says it (`parse_progress`)."""

    step: int
    total: int
    elapsed: str
    eta: str


_PROGRESS = re.compile(r"^step (\d+)/(\d+) \[[#.]*\] (\S+) elapsed, ETA (\S+) \|")


def parse_progress(line: str) -> StepProgress | None:
    """A `ConsoleBackend` step line read back (what `posttrain compare` shows of a run writing to its log);
    None for any other line (a step-0 validation line has no total)."""
    found = _PROGRESS.match(line)
    if found is None:
        return None
    return StepProgress(int(found[1]), int(found[2]), found[3], found[4])


class FileBackend:
    """`metrics.jsonl` in the run folder: one JSON object per step (`{"step": N, ...metrics}`)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}) + "\n")

    def finish(self) -> None:
        pass


class TensorboardBackend:
    def __init__(self, run_dir: Path):
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(os.environ.get("TENSORBOARD_DIR", run_dir / "tensorboard")))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandbBackend:
    """Honours WANDB_MODE (offline writes under the run folder)."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict):
        wandb = _require("wandb", "wandb")
        self.run = wandb.init(project=project, name=experiment, config=config, dir=str(run_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowBackend:
    """Writes to MLFLOW_TRACKING_URI, or a file store under the run folder."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict):
        self.mlflow = _require("mlflow", "mlflow")
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # recent mlflow refuses file stores unless opted in; a sqlite store would run its schema migrations at every start.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.mlflow.set_tracking_uri(uri)
        self.mlflow.set_experiment(project)
        self.run = self.mlflow.start_run(run_name=experiment)
        flat = {k: str(v)[:250] for k, v in _flatten(config).items()}
        for i in range(0, len(flat), 100):  # mlflow caps params per call
            self.mlflow.log_params(dict(list(flat.items())[i:i + 100]))

    def log(self, metrics: dict[str, float], step: int) -> None:
        safe = {k.replace("@", "_at_"): float(v) for k, v in metrics.items() if _finite(v)}
        self.mlflow.log_metrics(safe, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


class Tracking:
    """Fan metrics out to every back end named in `trainer.logger`."""

    def __init__(self, loggers: list[str], run_dir: str | Path, project: str, experiment: str,
                 config: dict | None = None, total_steps: int | None = None):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        config = config or {}
        makers = {
            "console": lambda: ConsoleBackend(total_steps),
            "file": lambda: FileBackend(run_dir),
            "tensorboard": lambda: TensorboardBackend(run_dir),
            "wandb": lambda: WandbBackend(run_dir, project, experiment, config),
            "mlflow": lambda: MlflowBackend(run_dir, project, experiment, config),
        }
        unknown = [name for name in loggers if name not in makers]
        if unknown:
            raise ConfigError(f"trainer.logger: unknown back end(s) {unknown}; valid: {', '.join(makers)}")
        self.backends: dict[str, Backend] = {name: makers[name]() for name in loggers}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) or hasattr(v, "item")}
        for backend in self.backends.values():
            backend.log(clean, step)

    def finish(self) -> None:
        for backend in self.backends.values():
            backend.finish()


BARE_STATISTICS = ("mean", "max", "min", "std", "step", "sum")
"""Last parts that name no subject on their own (``response_length/mean``): such a column keeps its full key."""


def column_name(key: str) -> str:
    """A console column's name: the metric without its group (``actor/pg_loss`` -> ``pg_loss``), unless
    that would leave a bare statistic (``response_length/mean`` stays whole) or it is a validation metric."""
    short = key.split("/", 1)[-1]
    return key if key.startswith("val") or short in BARE_STATISTICS else short


def column_names(keys: list[str]) -> dict[str, str]:
    """`column_name` of each key, except where two keys would share a name (``trainer/idle_ratio`` and
    ``rollouter/idle_ratio``): those keep their full keys, so no column is ambiguous."""
    short = {k: column_name(k) for k in keys}
    taken = [short[k] for k in keys]
    return {k: k if taken.count(short[k]) > 1 else short[k] for k in keys}


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): node}


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _jsonable(v: Any) -> Any:
    v = float(v)
    return v if math.isfinite(v) else str(v)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
