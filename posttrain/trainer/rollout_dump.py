"""Rollouts on disk: verl's ``trainer.rollout_data_dir`` (each training step's responses) and
``trainer.validation_data_dir`` (each validation's), written as verl's ``_dump_generations`` names them,
``<folder>/<step>.jsonl``, one JSON object per response (fields: `posttrain.trainer.rollout_records`), and
read by ``posttrain view`` one step at a time.

A folder holds:

- ``<step>.jsonl``: the step's responses, each prompt's group together; written whole to a temporary
  name and renamed, so a reader never sees half a file.
- ``index.jsonl``: one line per step written (after its file): ``step``, ``file``, ``bytes`` and a
  summary (`rollout_records.step_summary`: mean score, groups all right / all wrong / scored alike,
  failed tool calls, the lowest-probability token), so a viewer lists a 1,000-step run without opening
  its steps. A step written again (a resumed run) adds a line; the last one counts.

The run folder (``trainer.run_dir``) gets ``rollout_dirs.json`` naming both folders, so ``posttrain view
RUN_FOLDER`` finds them wherever they are.

Bounded: every response's text and numbers (verl's fields) are written, but per-token values only for
the first `TOKEN_SAMPLES_PER_STEP` responses of a step (whole groups), and a folder stops growing at
`MAX_FOLDER_BYTES` (later steps get an index line saying so, and the run prints one line). A failed
write (a full disk) prints one line and ends the dumps, not the run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from posttrain.trainer.rollout_records import TokenText, batch_records, step_summary

__all__ = ["INDEX", "MAX_FOLDER_BYTES", "POINTER", "RolloutDumps", "SampleDump", "TOKEN_SAMPLES_PER_STEP",
           "describe", "step_file"]

INDEX = "index.jsonl"
POINTER = "rollout_dirs.json"  # in the run folder: {"rollout_data_dir": ..., "validation_data_dir": ...}
TOKEN_SAMPLES_PER_STEP = 64
"""Responses per step (whole groups, at least one) that carry per-token values (tokens, log-probs, entropy)."""
MAX_FOLDER_BYTES = 1 << 30
"""A dump folder stops growing here (1 GiB): later steps are indexed as not written."""


def step_file(step: int) -> str:
    return f"{step}.jsonl"


def _json_line(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=str) + "\n"


def _folder_bytes(folder: Path) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
    except OSError:  # not there yet (or not a folder: the first write says so)
        return 0


class SampleDump:
    """One dump folder: ``write(step, records)`` writes ``<step>.jsonl`` and its index line.

    Args:
        folder: ``trainer.rollout_data_dir`` or ``trainer.validation_data_dir``.
        kind: ``train`` or ``val`` (in the index lines).
        max_bytes: the folder's bound.
    """

    def __init__(self, folder: str | os.PathLike, kind: str, max_bytes: int = MAX_FOLDER_BYTES):
        self.folder, self.kind, self.max_bytes = Path(folder).expanduser(), kind, max_bytes
        self.used = _folder_bytes(self.folder)
        self.full = self.failed = False

    def write(self, step: int, records: list[dict]) -> None:
        if self.failed:
            return
        data = "".join(_json_line(r) for r in records).encode("utf-8")
        entry = {"step": step, "kind": self.kind, "file": step_file(step), "bytes": len(data),
                 **step_summary(records), "time": round(time.time(), 3)}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if self.used + len(data) > self.max_bytes:
                entry["file"], entry["skipped"] = None, f"the folder reached its bound of {_size(self.max_bytes)}"
                if not self.full:
                    print(f"rollouts on disk: {self.folder} reached its bound of {_size(self.max_bytes)} at step "
                          f"{step}; later steps are listed in {INDEX} but not written", flush=True)
                self.full = True
            else:
                tmp = self.folder / f".{step_file(step)}.tmp"
                tmp.write_bytes(data)
                os.replace(tmp, self.folder / step_file(step))
                self.used += len(data)
            line = _json_line(entry).encode("utf-8")
            with open(self.folder / INDEX, "ab") as f:
                f.write(line)
            self.used += len(line)
        except OSError as err:
            from posttrain.host.disk import write_failure_message

            self.failed = True
            print(write_failure_message(err, self.folder, f"rollouts on disk (step {step})",
                                        "unset the key to stop writing them") + "; the run goes on without them",
                  flush=True)


class RolloutDumps:
    """The run's two dumps (either may be None) and how a batch becomes records.

    Args:
        train, val: the `SampleDump` of ``trainer.rollout_data_dir`` / ``trainer.validation_data_dir``.
        tokenizer: decodes prompts, responses and single tokens.
        token_samples: responses per step with per-token values.
    """

    def __init__(self, train: SampleDump | None, val: SampleDump | None, tokenizer: Any,
                 token_samples: int = TOKEN_SAMPLES_PER_STEP):
        self.train, self.val, self.token_samples = train, val, token_samples
        self.text = TokenText(tokenizer)

    @classmethod
    def from_config(cls, config: Any, tokenizer: Any, writes: bool = True) -> "RolloutDumps":
        """The dumps ``config.trainer`` asks for (none on a rank that does not write); the run folder's
        ``rollout_dirs.json`` names them."""
        from posttrain.trainer.setup import run_dir

        t = config.trainer
        train = SampleDump(t.rollout_data_dir, "train") if writes and t.rollout_data_dir else None
        val = SampleDump(t.validation_data_dir, "val") if writes and t.validation_data_dir else None
        if train is not None or val is not None:
            _write_pointer(run_dir(config), train, val)
        return cls(train, val, tokenizer)

    def step(self, step: int, batch: Any, extra: dict | None = None, entropy: Any = None) -> dict[str, float]:
        """Write a training step's responses; returns ``timing_s/dump_rollouts`` (nothing when not dumping)."""
        if self.train is None:
            return {}
        start = time.perf_counter()
        self.train.write(step, batch_records(batch, self.text, step, extra=extra, entropy=entropy,
                                             token_samples=self.token_samples))
        return {"timing_s/dump_rollouts": time.perf_counter() - start}

    def validation(self, step: int, samples: Sequence[dict]) -> None:
        """Write a validation's responses: ``samples`` as `posttrain.trainer.validation.run_validation`
        returns them (``{"batch": generated Batch, "scores": [per response]}`` per prompt batch)."""
        if self.val is None:
            return
        records: list[dict] = []
        for part in samples:
            budget = max(0, self.token_samples - sum(1 for r in records if "tokens" in r))
            records += batch_records(part["batch"], self.text, step, scores=part.get("scores"),
                                     extra=part.get("extra"), token_samples=budget, first_sample=len(records))
        self.val.write(step, records)


def _write_pointer(folder: Path, train: SampleDump | None, val: SampleDump | None) -> None:
    pointer = {"rollout_data_dir": str(train.folder.resolve()) if train else None,
               "validation_data_dir": str(val.folder.resolve()) if val else None}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{POINTER}.tmp"
        tmp.write_text(json.dumps(pointer, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, folder / POINTER)
    except OSError as err:  # the viewer still finds <run>/rollouts; the dumps themselves say if they fail
        print(f"rollouts on disk: cannot write {folder / POINTER}: {err.strerror or err}", flush=True)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def describe(config: Any, total_steps: int | None = None) -> str | None:
    """What the run writes to disk of its samples, lines for `posttrain plan`, with an upper estimate of the
    size (every prompt and response at its full length); None when neither key is set."""
    t = config.trainer
    if not (t.rollout_data_dir or t.validation_data_dir):
        return None
    responses = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
    p_len, r_len = int(config.data.max_prompt_length), int(config.data.max_response_length)
    with_tokens = min(responses, TOKEN_SAMPLES_PER_STEP)
    # ~4 characters a token for the prompt and response text (written once per response, as verl does),
    # ~300 bytes of numbers and names, ~45 bytes a token for the per-token values (text, id, 2-3 log-probs)
    per_step = responses * (4 * (p_len + r_len) + 300) + with_tokens * r_len * 45
    lines = []
    if t.rollout_data_dir:
        total = f", up to {_size(min(per_step * total_steps, MAX_FOLDER_BYTES))} for {total_steps} steps" if total_steps else ""
        lines.append(f"{Path(t.rollout_data_dir) / '<step>.jsonl'} (trainer.rollout_data_dir): {responses} responses "
                     f"a step, per-token log-probs for {with_tokens}; up to ~{_size(per_step)} a step{total}")
    if t.validation_data_dir:
        lines.append(f"{Path(t.validation_data_dir) / '<step>.jsonl'} (trainer.validation_data_dir): each "
                     "validation's responses")
    lines.append(f"bounded: per-token values for {TOKEN_SAMPLES_PER_STEP} responses a step, {_size(MAX_FOLDER_BYTES)} "
                 "a folder; look at them with `posttrain view`")
    return "\n".join(lines)
