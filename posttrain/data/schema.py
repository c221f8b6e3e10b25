"""Reading prompt files in verl's RL schema, with errors that name the file, row and field.

One row of a prompt file (parquet or JSON lines)::

    {
        "data_source": "openai/gsm8k",                     # str: picks the scorer
        "prompt": [{"role": "user", "content": "..."}],    # list of chat messages
        "ability": "math",                                 # str (optional)
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, ...}, # dict (optional)
    }
"""

from __future__ import annotations

import json
import os
from typing import Any

from posttrain.host.disk import folder_problem, writing
from posttrain.errors import DataError, read_utf8  # DataError re-exported: data's error, defined on the ground floor

__all__ = ["DataError", "SUPPORTED_SUFFIXES", "read_rows", "write_rows", "validate_row"]

SUPPORTED_SUFFIXES = (".parquet", ".jsonl", ".json")


def read_rows(path: str) -> list[dict[str, Any]]:
    """All rows of a ``.parquet``, ``.jsonl`` or ``.json`` (array or JSON lines) file as dicts."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory; give a {'/'.join(SUPPORTED_SUFFIXES)} file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    if path.endswith(".jsonl") or path.endswith(".json"):
        return _read_json(path)
    raise DataError(f"{path}: unsupported file type; expected one of {', '.join(SUPPORTED_SUFFIXES)}")


def _read_json(path: str) -> list[dict[str, Any]]:
    text = read_utf8(path, DataError)
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON ({e})") from e
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from e
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is a {type(row).__name__}, expected a JSON object")
    return rows


def write_rows(rows: list[dict[str, Any]], path: str) -> None:
    """Write rows to parquet (by suffix ``.parquet``) or JSON lines, into a temporary file renamed into
    place: a full disk leaves no half-written file, and is one `DiskWriteError` naming the path."""
    folder = os.path.dirname(os.path.abspath(path))
    blocked = folder_problem(folder)
    if blocked:
        raise DataError(f"cannot write {path}: {blocked}; choose another output folder")
    if os.path.isdir(path):
        raise DataError(f"cannot write {path}: it is a folder; give a file name ending in .parquet or .jsonl")
    tmp = os.path.join(folder, f".tmp_{os.path.basename(path)}_{os.getpid()}")
    try:
        with writing(path, f"writing {len(rows)} rows failed", "choose an output folder on another disk"):
            os.makedirs(folder, exist_ok=True)
            _write_rows_to(rows, tmp, parquet=path.endswith(".parquet"))
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_rows_to(rows: list[dict[str, Any]], path: str, parquet: bool) -> None:
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = dict.fromkeys(key for row in rows for key in row)  # pyarrow alone keeps only the first row's
        pq.write_table(pa.Table.from_pylist([{key: row.get(key) for key in columns} for row in rows]), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def validate_row(row: dict, where: str, prompt_key: str = "prompt", reward_fn_key: str = "data_source") -> None:
    """Raise :class:`DataError` (prefixed with ``where``, e.g. ``"train.parquet row 3"``) for a bad row."""
    if reward_fn_key not in row or row[reward_fn_key] is None:
        raise DataError(f"{where}: missing field {reward_fn_key!r} (data.reward_fn_key); fields: {sorted(row)}")
    if prompt_key not in row or row[prompt_key] is None:
        raise DataError(f"{where}: missing field {prompt_key!r} (data.prompt_key); fields: {sorted(row)}")
    messages = row[prompt_key]
    if not isinstance(messages, (list, tuple)):
        raise DataError(
            f"{where}: field {prompt_key!r} must be a list of {{'role', 'content'}} messages, "
            f"got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise DataError(f"{where}: field {prompt_key!r} is an empty list of messages")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: field {prompt_key!r} message {j} must be a dict with string 'role' and 'content', got {m!r}"
            )
    if all(not m["content"].strip() for m in messages):
        raise DataError(f"{where}: field {prompt_key!r} has only empty message contents")
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise DataError(f"{where}: missing field 'reward_model.ground_truth' (got reward_model={rm!r})")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}: field 'extra_info' must be a dict, got {type(extra).__name__}")
