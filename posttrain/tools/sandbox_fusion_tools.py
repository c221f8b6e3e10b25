"""verl's code-interpreter tool (``verl.tools.sandbox_fusion_tools.SandboxFusionTool``):
``code_interpreter(code: str)`` runs the model's code and answers with what it printed.

Where the code runs:

- ``sandbox_fusion_url`` set: POSTed to that SandboxFusion server's ``/run_code`` (or to
  ``posttrain sandbox serve``, which speaks the same JSON), as verl does.
- no URL: in posttrain's local sandbox (:class:`posttrain.sandbox.LocalSandbox`) with the YAML's
  limits; its ``isolation`` key (posttrain's) asks for an isolation level, and the tool refuses to
  start when the machine cannot give it.

verl's keys and defaults: ``num_workers`` 10 (calls of this tool running at once), ``rate_limit`` 10
(calls in flight at once; with ``enable_global_rate_limit`` true, the default, one limit shared by
every such tool of the process, as verl's named ``rate-limiter`` actor is; the first tool sets its size),
``default_timeout`` 30 s, ``default_language`` python, ``memory_limit_mb`` 1024 (for the whole run). posttrain's
``sandbox_token_file`` (with a URL): the file holding the token `posttrain sandbox serve` asks for, sent as
``Authorization: Bearer``; without it ``$POSTTRAIN_SANDBOX_TOKEN`` is sent where set. Every key is checked
at start-up; a bad one is one ConfigError naming the tool, the key and what is valid (the loader adds
the file). The model cannot change the time-out or language of a call (verl lets the call's
arguments override them; a model-chosen time-out is a way around the limit).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from posttrain.errors import ConfigError
from posttrain.tools.base_tool import BaseTool
from posttrain.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from posttrain.tools.utils.sandbox_fusion_client import (NOT_KILLED, TOKEN_ENV, RunOutcome, post_run_code,
                                                         shared_limit)

__all__ = ["SandboxFusionTool", "CODE_INTERPRETER_SCHEMA", "SANDBOX_FUSION_LANGUAGES"]

CODE_INTERPRETER_SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code and read what it prints (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to run; print the result."}},
            "required": ["code"],
        },
    },
}

# The languages SandboxFusion's /run_code accepts (its documentation's list).
SANDBOX_FUSION_LANGUAGES = ("python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash",
                            "typescript", "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala",
                            "julia", "pytest", "junit", "kotlin_script", "jest", "verilog", "python_gpu", "lean",
                            "swift", "racket")
LOCAL_LANGUAGES_DEFAULT = ("python",)
ISOLATION_LEVELS = ("auto", "namespaces", "bwrap", "none")
MAX_TIMEOUT_S = 3600.0
MEMORY_RANGE_MB = (64, 65536)
MAX_WORKERS = 1024
CONFIG_KEYS = ("type", "sandbox_fusion_url", "default_timeout", "default_language", "memory_limit_mb",
               "num_workers", "rate_limit", "enable_global_rate_limit", "isolation", "sandbox_token_file")


class SandboxFusionTool(BaseTool):
    """``code_interpreter(code)``; config keys and where the code runs: module docstring.

    ``execute`` returns ``(ToolResponse(text), 0.0, metrics)``: ``metrics`` has ``tool_error`` 1.0 when
    the code failed or could not run, ``tool_timeout`` 1.0 when it ran past ``default_timeout``, and
    ``sandbox_kill`` naming the limit that ended it (the sandbox's status: ``timeout``, ``cpu``, ``memory``,
    ``file_size``, ``processes``, ``output``, ``killed``).
    """

    def __init__(self, config: dict | None = None, tool_schema: OpenAIFunctionToolSchema | dict | None = None):
        super().__init__(config, tool_schema if tool_schema is not None else CODE_INTERPRETER_SCHEMA)
        where = f"tool {self.name!r}: config"
        cfg = self.config
        _check_known_keys(cfg, where, CONFIG_KEYS)
        self.sandbox_fusion_url = _url(cfg.get("sandbox_fusion_url") or "", where)
        self.default_timeout = _number(cfg, "default_timeout", 30, where, 0.0, MAX_TIMEOUT_S, exclusive_low=True)
        self.memory_limit_mb = int(_number(cfg, "memory_limit_mb", 1024, where, *MEMORY_RANGE_MB, integer=True))
        self.num_workers = int(_number(cfg, "num_workers", 10, where, 1, MAX_WORKERS, integer=True))
        self.rate_limit = int(_number(cfg, "rate_limit", 10, where, 1, MAX_WORKERS * 64, integer=True))
        self.enable_global_rate_limit = _flag(cfg, "enable_global_rate_limit", True, where)
        if self.sandbox_fusion_url and "isolation" in cfg:
            raise ConfigError(f"{where}.isolation: applies to the local sandbox only; with sandbox_fusion_url the "
                              "server's own isolation holds (remove one of the two keys)")
        if not self.sandbox_fusion_url and "sandbox_token_file" in cfg:
            raise ConfigError(f"{where}.sandbox_token_file: a server's token; without sandbox_fusion_url the code runs "
                              "in the local sandbox (remove the key, or name the server)")
        self._token = _token(cfg, where) if self.sandbox_fusion_url else None
        self.sandbox = None if self.sandbox_fusion_url else self._local_sandbox(cfg, where)
        languages = SANDBOX_FUSION_LANGUAGES if self.sandbox_fusion_url else _local_languages()
        self.default_language = _choice(cfg, "default_language", "python", where, languages,
                                        "" if self.sandbox_fusion_url else " (the local sandbox; "
                                        "set sandbox_fusion_url for SandboxFusion's other languages)")
        self._pool = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix=f"{self.name}-call")
        self._in_flight = (shared_limit(self.rate_limit) if self.enable_global_rate_limit
                           else threading.BoundedSemaphore(self.rate_limit))
        self._instance_dict: dict[str, dict[str, Any]] = {}

    def _local_sandbox(self, cfg: dict, where: str) -> Any:
        """A LocalSandbox with the YAML's limits (ConfigError when its isolation is not available). Its
        runs at once are capped by the process's run slots (verl's retool YAML asks for 128 workers)."""
        from posttrain.sandbox import Limits, LocalSandbox
        from posttrain.sandbox.local import MAX_WORKERS as LOCAL_RUNS_AT_ONCE

        isolation = _choice(cfg, "isolation", "auto", where, ISOLATION_LEVELS, "")
        limits = Limits(timeout_s=self.default_timeout, memory_mb=self.memory_limit_mb, isolation=isolation)
        try:
            return LocalSandbox(limits, num_workers=min(self.num_workers, LOCAL_RUNS_AT_ONCE))
        except ConfigError as err:
            raise ConfigError(f"{where}.isolation={isolation!r}: {err}") from None

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any):
        instance_id = instance_id or str(uuid.uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": []}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        code = parameters.get("code", "") if isinstance(parameters, dict) else ""
        code = code if isinstance(code, str) else str(code)
        loop = asyncio.get_running_loop()
        outcome = await loop.run_in_executor(self._pool, self.execute_code, instance_id, code)
        metrics: dict[str, Any] = {"tool_error": 1.0} if outcome.error else {}
        if outcome.kill:
            metrics["sandbox_kill"] = outcome.kill
            if outcome.kill == "timeout":
                metrics["tool_timeout"] = 1.0
        return ToolResponse(outcome.text), 0.0, metrics

    def execute_code(self, instance_id: str, code: str) -> RunOutcome:
        """Run ``code`` (blocking; one of this tool's worker threads) within the in-flight limit."""
        with self._in_flight:
            if self.sandbox_fusion_url:
                return post_run_code(self.sandbox_fusion_url, code, self.default_language, self.default_timeout,
                                     self.memory_limit_mb, self._token)
            return _local_outcome(self.sandbox.run(code, self.default_language))

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0  # the code's output carries no score; the task's reward function judges the answer

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instance_dict.pop(instance_id, None)


def _local_outcome(result: Any) -> RunOutcome:
    """A local RunResult in the tool's terms (its text is what the sandbox says the model reads)."""
    kill = result.status if result.status not in NOT_KILLED else None
    return RunOutcome(result.as_tool_text(), error=result.status != "ok", kill=kill)


def _local_languages() -> tuple[str, ...]:
    import posttrain.sandbox as sandbox

    return tuple(getattr(sandbox, "LANGUAGES", LOCAL_LANGUAGES_DEFAULT))


# ---------------------------------------------------------------------- start-up checks of the config
def _check_known_keys(cfg: dict, where: str, known: tuple[str, ...]) -> None:
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {unknown}; valid keys: {', '.join(known)}")


def _url(value: Any, where: str) -> str:
    """``http(s)://host[:port][/path]``; a URL without a path gets SandboxFusion's ``/run_code``."""
    rule = "expected http(s)://host[:port][/path], e.g. http://localhost:8080/run_code (or no key: the local sandbox)"
    if value == "":
        return ""
    try:
        parts = urlsplit(value) if isinstance(value, str) else None
        port_ok = parts is not None and (parts.port is None or 0 < parts.port < 65536)
    except ValueError:  # a port that is not a number
        parts, port_ok = None, False
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or parts.query or parts.fragment or any(c.isspace() for c in value):
        raise ConfigError(f"{where}.sandbox_fusion_url={value!r}: {rule}")
    return value if parts.path not in ("", "/") else value.rstrip("/") + "/run_code"


def _token(cfg: dict, where: str) -> str | None:
    """The server's token: the file ``sandbox_token_file`` names, else $POSTTRAIN_SANDBOX_TOKEN, else none."""
    import os

    path = cfg.get("sandbox_token_file")
    if path is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        token = open(os.path.expanduser(str(path)), encoding="utf-8").read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where}.sandbox_token_file={path!r}: cannot read it ({err})") from None
    if not token:
        raise ConfigError(f"{where}.sandbox_token_file={path!r}: the file is empty")
    return token


def _number(cfg: dict, key: str, default: float, where: str, low: float, high: float,
            integer: bool = False, exclusive_low: bool = False) -> float:
    value = cfg.get(key, default)
    kind = int if integer else (int, float)
    wrong_type = isinstance(value, bool) or not isinstance(value, kind)
    if wrong_type or (value <= low if exclusive_low else value < low) or value > high:
        low_text = f"> {low:g}" if exclusive_low else f">= {low:g}"
        raise ConfigError(f"{where}.{key}={value!r}: expected {'an integer' if integer else 'a number'} "
                          f"{low_text} and <= {high:g}")
    return value


def _flag(cfg: dict, key: str, default: bool, where: str) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key}={value!r}: expected true or false")
    return value


def _choice(cfg: dict, key: str, default: str, where: str, valid: tuple[str, ...], note: str) -> str:
    value = cfg.get(key, default)
    if value not in valid:
        raise ConfigError(f"{where}.{key}={value!r}: expected one of {', '.join(valid)}{note}")
    return value
