"""The eval card: what an evaluation's numbers were measured on, written as JSON beside them, so that a number
can be reproduced and compared honestly. Every in-run validation (``<run_dir>/eval_cards/step_<N>.json``)
and every ``posttrain eval`` (``--output``, one file per run) writes one.

One JSON object, every key always present (null where unknown):

    format         "posttrain.eval_card/1"
    kind           "validation" (in a training run) or "eval" (posttrain eval)
    step           the training step whose weights were evaluated (validation), else null
    date           when it was written, UTC, ISO 8601
    model          {"path": as given, "weights_sha256": sha256 over every tensor's name, dtype, shape and
                    bytes in name order (null when not computed, "weights_note" says why), "dtype":
                    the weights' dtype(s), "compute_dtype": what the forward ran in, "parameters": count}
    data           [{"path", "sha256": of the file's bytes, "bytes"}], "prompts": how many were evaluated
    chat_template  {"sha256": of the template text, "chars", "source": "tokenizer" or
                    "custom_chat_template"}, or null when the tokenizer has none
    sampling       {"engine", "n_requested": val_kwargs.n, "n": responses per prompt generated,
                    "do_sample", "temperature", "top_p", "top_k", "max_response_length"}
    seed           the seed sampling drew from (trainer.seed), and the bootstrap's ("bootstrap_seed")
    scorer         {"compute_score": the function, "file", "file_sha256" (a custom reward function's file),
                    "reward_manager", "reward_model": the reward model's path or null, "correct_if":
                    what pass@k counts as a correct response}
    metrics        {name: value}: the numbers this card describes (verl's names, see
                   posttrain.trainer.validation)
    conventions    {metric family: one sentence defining it}
    posttrain      {"version", "git_commit": the checkout's HEAD when posttrain runs from one, else null,
                    "git_dirty": whether posttrain/'s tracked files differ from that commit}
    machine        {"cpu": model name, "cpu_flags": the flags that change speed or bf16 numerics (avx2,
                    avx512f, avx512_bf16, amx_bf16, ...), "cores", "threads": torch's, "accelerator":
                    the GPU's name or null, "torch", "python", "platform"}

Build one with `build_card` (plain values in, a dict out; `model_weights_sha256`, `files_info`,
`chat_template_info`, `machine_info` and `posttrain_info` gather the parts) and write it with `write_card`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["CONVENTIONS", "FORMAT", "build_card", "chat_template_info", "files_info", "machine_info",
           "model_weights_sha256", "posttrain_info", "sampling_info", "scorer_info", "write_card",
           "write_validation_card"]

FORMAT = "posttrain.eval_card/1"

CONVENTIONS = {
    "mean@N": "mean over a prompt's N responses, averaged over prompts (verl 0.9.1)",
    "best@N": "bootstrap (1000 draws of N responses with replacement, seed 42) of the best value; mean and std "
              "over draws, averaged over prompts (verl 0.9.1; biased low as an estimate of pass@N)",
    "worst@N": "as best@N with the worst value (verl 0.9.1)",
    "maj@N": "as best@N, scoring the first response of the most common pred (ties: the first drawn) (verl 0.9.1)",
    "pass@k": "unbiased estimator 1 - C(N-c, k)/C(N, k) per prompt, c correct of N (Chen et al. 2021), "
              "averaged over prompts",
}

CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "bf16", "i8mm", "sve", "sve2")
"""The CPU flags a card names: the vector units the kernels use, and bf16/int8 support (which changes what
``param_dtype=auto`` picks, hence the numbers)."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def files_info(paths: Any) -> list[dict[str, Any]]:
    """[{"path", "sha256", "bytes"}] for a file or a list of files (sha256 null for one that cannot be read)."""
    out = []
    for p in [paths] if isinstance(paths, (str, os.PathLike)) else list(paths or []):
        try:
            out.append({"path": str(p), "sha256": sha256_file(p), "bytes": os.path.getsize(p)})
        except OSError:
            out.append({"path": str(p), "sha256": None, "bytes": None})
    return out


def model_weights_sha256(module: Any) -> tuple[str | None, dict[str, Any]]:
    """(sha256 of the module's state dict, {"dtype", "parameters"}), or (None, {"weights_note": why}) when
    its tensors are shards of a model spread over ranks (the hash would be this rank's part only)."""
    import torch

    h, dtypes = hashlib.sha256(), set()
    for name, tensor in sorted(module.state_dict().items()):
        if type(tensor).__name__ == "DTensor":
            return None, {"weights_note": "sharded over ranks (FSDP): not hashed"}
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        dtypes.add(str(t.dtype).removeprefix("torch."))
    count = sum(p.numel() for p in module.parameters())  # tied weights (embeddings and head) once
    return h.hexdigest(), {"dtype": ",".join(sorted(dtypes)), "parameters": count}


def chat_template_info(tokenizer: Any, custom: str | None = None) -> dict[str, Any] | None:
    """The template the prompts were rendered with, as its sha256 and length (None: the tokenizer has none)."""
    text = getattr(tokenizer, "chat_template", None)
    if not isinstance(text, str):
        return None
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text),
            "source": "custom_chat_template" if custom else "tokenizer"}


def machine_info() -> dict[str, Any]:
    """CPU model and flags, cores, torch's threads, the accelerator, versions."""
    import torch

    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu in (platform.processor(), platform.machine(), ""):
                cpu = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags.update(value.split())
    except OSError:
        pass
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cpu_flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "accelerator": accelerator, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def posttrain_info() -> dict[str, Any]:
    """posttrain's version, the git commit of the checkout it runs from and whether the package's tracked files
    differ from it (both null when installed)."""
    import importlib.metadata

    try:  # the installed distribution's version (the package's __init__ would be an import circle)
        version = importlib.metadata.version("posttrain")
    except importlib.metadata.PackageNotFoundError:
        version = None
    root = Path(__file__).resolve().parents[2]
    commit = dirty = None
    if (root / ".git").exists():
        try:
            git = ["git", "-C", str(root)]
            commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
            changed = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no", "--", "posttrain"],
                                     capture_output=True, text=True, timeout=5).stdout
            commit, dirty = commit or None, bool(changed.strip()) if commit else None
        except (OSError, subprocess.SubprocessError):
            pass
    return {"version": version, "git_commit": commit, "git_dirty": dirty}


def build_card(*, kind: str, model: dict[str, Any], data: list[dict[str, Any]], prompts: int | None,
               chat_template: dict[str, Any] | None, sampling: dict[str, Any], seed: int | None,
               scorer: dict[str, Any], metrics: dict[str, float], step: int | None = None,
               bootstrap_seed: int = 42) -> dict[str, Any]:
    """The card (module docstring) from its parts; the date, posttrain and machine are filled in here."""
    if kind not in ("validation", "eval"):
        raise ValueError(f"kind={kind!r}: 'validation' or 'eval'")
    return {
        "format": FORMAT, "kind": kind, "step": step,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model, "data": data, "prompts": prompts, "chat_template": chat_template, "sampling": sampling,
        "seed": seed, "bootstrap_seed": bootstrap_seed, "scorer": scorer,
        "metrics": {k: float(v) for k, v in sorted(metrics.items())}, "conventions": dict(CONVENTIONS),
        "posttrain": posttrain_info(), "machine": machine_info(),
    }


def write_card(card: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``card`` as indented JSON (through a temporary file: a reader never sees half a card)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(card, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def sampling_info(rollout: Any) -> dict[str, Any]:
    """The validation sampling ``actor_rollout_ref.rollout`` asks for (``val_kwargs``), as the engine gets it."""
    from posttrain.rollout import SamplingParams

    sp = SamplingParams.from_rollout_config(rollout, validate=True)
    return {"engine": rollout.name, "n_requested": int(rollout.val_kwargs.n), "n": sp.n, "do_sample": sp.do_sample,
            "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
            "max_response_length": sp.response_length}


def scorer_info(config: Any) -> dict[str, Any]:
    """What scored the responses: the custom reward function (its file hashed) or the built-in ones."""
    from posttrain.trainer.validation import CORRECT_AT_LEAST

    crf, rm = config.custom_reward_function, config.reward_model
    custom = files_info(os.path.expanduser(crf.path))[0] if crf.path else None
    return {"compute_score": f"{crf.path}:{crf.name}" if crf.path else
            "posttrain.rewards.default_compute_score (by data_source)",
            "file": custom and custom["path"], "file_sha256": custom and custom["sha256"],
            "reward_manager": rm.reward_manager, "reward_model": rm.model.path if rm.enable else None,
            "correct_if": f"acc >= {CORRECT_AT_LEAST:g} where the scorer returns acc, else reward >= {CORRECT_AT_LEAST:g}"}


def write_validation_card(config: Any, metrics: dict[str, float], *, step: int, tokenizer: Any, workers: Any,
                          prompts: int | None = None) -> Path | None:
    """An in-run validation's card at ``<run_dir>/eval_cards/step_<step>.json`` (the process that writes the
    run's metrics only; None elsewhere). The weights are the actor's as validated (hashed where they live in
    this process whole; a run over ranks records why not)."""
    if not getattr(workers, "writes", True):
        return None
    from posttrain.trainer.setup import data_files, run_dir

    actor = getattr(workers, "actor", None)
    module = getattr(actor, "module", None)
    if module is not None:
        digest, weights = model_weights_sha256(module)
    else:
        digest, weights = None, {"weights_note": "the actor lives in other processes (Ray ranks): not hashed"}
    m = config.actor_rollout_ref.model
    fsdp = config.actor_rollout_ref.actor.fsdp_config
    model = {"path": m.path, "weights_sha256": digest, "compute_dtype": fsdp.mixed_precision.param_dtype,
             **weights}
    card = build_card(kind="validation", step=step, model=model, data=files_info(data_files(config)[1]),
                      prompts=prompts, chat_template=chat_template_info(tokenizer, m.custom_chat_template),
                      sampling=sampling_info(config.actor_rollout_ref.rollout), seed=config.trainer.seed,
                      scorer=scorer_info(config), metrics=metrics)
    return write_card(card, run_dir(config) / "eval_cards" / f"step_{step}.json")
