"""Every metric back end, written for real and read back; a missing package names its extra."""

from __future__ import annotations

import glob
import importlib
import json
import struct
import sys
import time

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.tracking import Tracking

STEPS = [  # (step, metrics); a tensor, an int and a NaN go through as the trainer sends them
    (1, {"actor/pg_loss": 0.5, "critic/score/mean": torch.tensor(0.25), "val-core/acc@1": 1}),
    (2, {"actor/pg_loss": -0.125, "critic/score/mean": 0.75, "val-core/acc@1": float("nan")}),
]


def _log_all(tracking: Tracking) -> None:
    for step, metrics in STEPS:
        tracking.log(metrics, step)
    tracking.finish()


def _import_or_skip(name: str):
    try:
        return importlib.import_module(name)
    except Exception as err:  # a broken install, not just a missing one
        pytest.skip(f"{name} does not import: {err}")


def test_file_backend_writes_one_json_line_per_step(tmp_path):
    _log_all(Tracking(["file"], tmp_path, "proj", "exp"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "actor/pg_loss": 0.5, "critic/score/mean": 0.25, "val-core/acc@1": 1.0},
        {"step": 2, "actor/pg_loss": -0.125, "critic/score/mean": 0.75, "val-core/acc@1": "nan"},
    ]


def test_console_backend_prints_headline_metrics_and_progress(tmp_path, capsys):
    _log_all(Tracking(["console"], tmp_path, "proj", "exp", total_steps=4))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 1/4 [#####...............]")
    assert "score/mean=0.25 pg_loss=0.5 val-core/acc@1=1" in lines[0]


def test_every_console_column_names_its_subject(tmp_path, capsys):
    """``response_length/mean=17.53`` and ``timing_s/step=3.1``, never a bare ``mean=17.53`` or ``step=3.1``."""
    from posttrain.tracking import BARE_STATISTICS, ConsoleBackend, column_name

    tracking = Tracking(["console"], tmp_path, "proj", "exp", total_steps=2)
    tracking.log({key: 1.5 for key in ConsoleBackend.HEADLINE}, 1)
    line = capsys.readouterr().out.splitlines()[0]
    columns = [part.split("=")[0] for part in line.split(" | ", 1)[1].split()]
    assert len(columns) == len(ConsoleBackend.HEADLINE)
    assert not set(columns) & set(BARE_STATISTICS), columns
    assert "response_length/mean" in columns and "timing_s/step" in columns and "pg_loss" in columns
    assert column_name("response_length/mean").split("/")[-1] == "mean"  # the statistic is still said


def test_console_shows_what_matters_per_run_kind(tmp_path, capsys):
    base = {"critic/score/mean": 0.5, "memory/peak_resident_gb": 2.5, "memory/tree_peak_gb": 5.9}
    tool = {**base, "multi_turn/tool_call_rate/mean": 0.75, "multi_turn/tool_calls/mean": 1.25}
    async_run = {**base, "perf/samples_per_s": 1.5, "trainer/idle_ratio": 0.03, "rollouter/idle_ratio": 0.58}
    tracking = Tracking(["console"], tmp_path, "proj", "exp", total_steps=3)
    for step, metrics in enumerate((base, tool, async_run), start=1):
        tracking.log(metrics, step)
    plain, with_tools, pooled = capsys.readouterr().out.splitlines()
    # the run's one memory figure, its process tree's peak; the process's own peak is not a second one
    assert "tree_peak_gb=5.9" in plain and "peak_resident_gb" not in plain
    assert "tool_call_rate" not in plain and "idle_ratio" not in plain and "samples_per_s" not in plain
    assert "tool_call_rate/mean=0.75" in with_tools
    # two idle ratios: each keeps its full key, so neither column is ambiguous
    assert "samples_per_s=1.5 trainer/idle_ratio=0.03 rollouter/idle_ratio=0.58" in pooled


def test_a_console_step_line_reads_back_as_progress(tmp_path, capsys):
    from posttrain.tracking import StepProgress, parse_progress

    tracking = Tracking(["console"], tmp_path, "proj", "exp", total_steps=15)
    tracking.log({"val-core/acc@1": 0.25}, 0)
    tracking.log({"critic/score/mean": 0.5}, 3)
    zero, three = capsys.readouterr().out.splitlines()
    assert parse_progress(zero) is None  # step 0 (the validation before training) has no total
    assert parse_progress(three) == StepProgress(3, 15, "0:00:00", "0:00:00")
    assert parse_progress("stepping 3/15 [#] 0:00:01 elapsed, ETA 0:00:02 | x=1") is None


def test_console_shows_the_rollout_actor_probability_gap(tmp_path, capsys):
    from posttrain.batch import Batch
    from posttrain.trainer.metrics import rollout_actor_diff

    # 2 responses x 3 tokens, the last token of the second masked out
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.8], [0.9, 0.1, 0.3]]))
    actor = torch.log(torch.tensor([[0.4, 0.25, 0.6], [0.9, 0.2, 0.99]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = Batch.from_dict({"rollout_log_probs": rollout, "old_log_probs": actor, "response_mask": mask})
    # |p_rollout - p_actor| on the 5 kept tokens: 0.1, 0, 0.2, 0, 0.1 -> mean 0.08 (0.69 masked out)
    metrics = {"critic/score/mean": 0.5, **rollout_actor_diff(batch)}
    assert metrics["training/rollout_actor_probs_diff_mean"] == pytest.approx(0.08)
    tracking = Tracking(["console"], tmp_path, "proj", "exp", total_steps=2)
    tracking.log(metrics, 1)
    tracking.log({"critic/score/mean": 0.5}, 2)  # negative control: a step without engine log-probs
    tracking.finish()
    first, second = capsys.readouterr().out.splitlines()
    assert "score/mean=0.5 rollout_actor_probs_diff_mean=0.08" in first
    assert "rollout_actor_probs_diff" not in second and "diff_max" not in first


def test_tensorboard_events_read_back(tmp_path, monkeypatch):
    _import_or_skip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    _log_all(Tracking(["tensorboard"], tmp_path, "proj", "exp"))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"actor/pg_loss", "critic/score/mean", "val-core/acc@1"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(1, 0.5), (2, -0.125)]
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.75)]


def test_mlflow_file_store_reads_back(tmp_path, monkeypatch):
    mlflow = _import_or_skip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # recorded so that undo removes what the backend sets
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    _log_all(Tracking(["mlflow"], tmp_path, "proj", "exp", config={"algorithm": {"adv_estimator": "grpo"}}))

    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "exp"
    assert run.data.params == {"algorithm.adv_estimator": "grpo"}
    history = client.get_metric_history(run.info.run_id, "actor/pg_loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, -0.125)]
    # "@" is not allowed in mlflow names; the NaN at step 2 is dropped.
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val-core/acc_at_1")] == [(1, 1.0)]


def _wandb_history(path: str) -> list[dict[str, str]]:
    """History rows of an offline ``run-*.wandb`` file (LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunk, rows = open(path, "rb").read(), 32768, 7, b"", []
    assert b":W&B".startswith(data[:4])  # the magic (or a file not written yet)
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # full or last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


def test_wandb_offline_run_records_the_history(tmp_path, monkeypatch):
    _import_or_skip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    _log_all(Tracking(["wandb"], tmp_path, "proj", "exp", config={"data": {"train_batch_size": 8}}))

    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + 10
    while len(rows := _wandb_history(run_file)) < len(STEPS) and time.monotonic() < deadline:
        time.sleep(0.05)  # wandb-core may still be writing the log when finish() returns
    assert [(row["_step"], row["actor/pg_loss"], row["critic/score/mean"]) for row in rows] == [
        ("1", "0.5", "0.25"), ("2", "-0.125", "0.75")]


@pytest.mark.parametrize("backend", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_package_names_the_extra(tmp_path, monkeypatch, backend):
    monkeypatch.setitem(sys.modules, backend, None)  # makes `import backend` raise ImportError
    expected = rf"trainer.logger includes '{backend}'.*pip install 'posttrain\[{backend}\]'"
    with pytest.raises(ConfigError, match=expected):
        Tracking(["console", backend], tmp_path, "proj", "exp")


def test_an_unknown_backend_lists_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown back end.*'tb'.*console, file, tensorboard, wandb, mlflow"):
        Tracking(["tb"], tmp_path, "proj", "exp")
