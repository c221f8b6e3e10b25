"""`posttrain export CHECKPOINT --output DIR`: a checkpoint's actor as a Hugging Face model folder.

CHECKPOINT is a ``global_step_N`` folder, its ``actor/`` subfolder, or a checkpoint root (then its
latest complete checkpoint). The model is rebuilt from ``actor/huggingface/config.json`` without any
``quantization_config`` (GGUF-loaded models carry one and transformers refuses to save them), the
weights are loaded strictly from ``model.safetensors`` (or gathered from the ranks' ``dcp/`` shards), and the folder is written with safetensors
plus the tokenizer, ready for ``AutoModelForCausalLM.from_pretrained(DIR)``.

A LoRA checkpoint holds the adapters alone (``actor/lora_adapter/``, a peft folder, and
``actor/lora_base.json``, the base model's path, dtype and weight digest): the base is loaded from
that path (refused when its weights are not the ones the adapters were trained on), the adapters
are merged into it (``W + alpha / r * B @ A``, peft's ``merge_and_unload``) and DIR gets the merged
model, plus ``DIR/lora_adapter/``, the adapter folder itself (``PeftModel.from_pretrained(base,
DIR/lora_adapter)``).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import os
import shutil
import sys
from pathlib import Path

import torch

from posttrain.checkpoint import (
    HF_DIR,
    MODEL_FILE,
    CheckpointError,
    CheckpointManager,
    CheckpointWriteError,
    verify_checkpoint,
)
from posttrain.checkpoint.layout import open_tensors
from posttrain.host.disk import os_error_of, readable_as_umask_says, write_failure_message
from posttrain.models.lora import ADAPTER_DIR
from posttrain.checkpoint.role import DCP_DIR, read_full_weights

__all__ = ["NonFiniteWeights", "build_parser", "export_actor", "main", "resolve_checkpoint"]

logger = logging.getLogger(__name__)


class NonFiniteWeights(CheckpointError):
    """The checkpoint's actor holds NaN or inf weights: a broken model is never exported."""


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The ``global_step_N`` folder meant by a step folder, its ``actor/`` subfolder or a checkpoint root."""
    path = Path(path)
    if path.name == "actor" and path.parent.name.startswith("global_step_"):
        return path.parent
    if path.name.startswith("global_step_"):
        return path
    manager = CheckpointManager(path)
    if manager.step_dirs() or manager.tracked_step() is not None:
        latest = manager.latest()
        if latest is None:
            raise CheckpointError(f"{path} holds no complete checkpoint")
        return latest
    what = (f"{path} is not a checkpoint: give a global_step_N folder, its actor/ subfolder, or a checkpoint root "
            "(trainer.default_local_dir)")
    if path.is_dir() and _looks_like_a_run_folder(path):
        exported = path / "hf_model"
        use = f"; the finished run's model is {exported}" if (exported / "config.json").exists() else ""
        raise CheckpointError(f"no checkpoint was saved here ({path}): trainer.save_freq=-1 keeps none (set "
                              f"trainer.save_freq=N to save every N steps){use}. {what}")
    raise CheckpointError(what)


def _looks_like_a_run_folder(path: Path) -> bool:
    """A checkpoint root a run claimed (its lock, a previous run moved aside, the final export) or an
    empty folder, as a run with trainer.save_freq=-1 leaves it."""
    names = {p.name for p in path.iterdir()}
    return not names or bool(names & {".lock", "hf_model"}) or any(n.startswith("previous_run_") for n in names)


def export_actor(checkpoint_path: str | os.PathLike, output_dir: str | os.PathLike) -> Path:
    """Write the actor of a checkpoint as a Hugging Face folder (safetensors + config + tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    step_dir = resolve_checkpoint(checkpoint_path)
    manifest = verify_checkpoint(step_dir)
    if "actor" not in manifest["roles"]:
        raise CheckpointError(f"{step_dir} has no actor (roles: {', '.join(manifest['roles'])})")
    actor = step_dir / "actor"
    hf_dir = actor / HF_DIR
    if not (hf_dir / "config.json").exists():
        raise CheckpointError(f"{hf_dir / 'config.json'} is missing: this checkpoint was saved without the "
                              "model config (RoleState.hf_config) and cannot be exported on its own")
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    adapter = actor / ADAPTER_DIR
    if (adapter / "adapter_config.json").exists():  # LoRA: base model + adapters, merged
        model = merged_lora_model(actor)
    elif (actor / DCP_DIR).is_dir():  # saved by FSDP2 ranks: DCP gathers the shards into the full model
        model = AutoModelForCausalLM.from_config(config)
        read_full_weights(actor, model)
    else:
        model = AutoModelForCausalLM.from_config(config).to(_weights_dtype(actor / MODEL_FILE))
        _load_strict(model, actor / MODEL_FILE)

    _check_finite(model, actor)
    out = _check_output(Path(output_dir), step_dir)

    def write(folder: Path) -> None:
        # transformers 4 needs safe_serialization=True; 5 dropped the argument and always writes safetensors.
        takes_flag = "safe_serialization" in inspect.signature(model.save_pretrained).parameters
        model.save_pretrained(folder, **({"safe_serialization": True} if takes_flag else {}))
        if (adapter / "adapter_config.json").exists():
            shutil.copytree(adapter, folder / ADAPTER_DIR)
        if (hf_dir / "tokenizer_config.json").exists():
            AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=False).save_pretrained(folder)
        else:
            logger.warning("%s has no tokenizer; exported the model only", hf_dir)

    _write_atomically(out, write)
    return out


def merged_lora_model(role_dir: Path) -> torch.nn.Module:
    """The base model named by ``role_dir/lora_base.json`` with ``role_dir/lora_adapter/`` merged in."""
    import warnings

    from peft import PeftModel

    from posttrain.models import load_causal_lm
    from posttrain.models.lora import base_digest, read_base_record, same_digest

    record = read_base_record(role_dir)
    path, dtype = record.get("model_path"), record.get("model_dtype", "fp32")
    try:
        base = load_causal_lm(path, dtype=dtype, device="cpu")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"the LoRA checkpoint {role_dir} was trained on the base model {path} "
                              f"({role_dir / 'lora_base.json'}), which cannot be loaded here: "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
    if not same_digest(base_digest(base), record.get("digest", {})):
        raise CheckpointError(f"the base model at {path} is not the one the LoRA adapters of {role_dir} were trained "
                              "on (its weights differ): merging them would give a different model")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        peft_model = PeftModel.from_pretrained(base, str(role_dir / ADAPTER_DIR))
    return peft_model.merge_and_unload()


def _check_finite(model: torch.nn.Module, source: Path) -> None:
    """Refuse weights holding NaN or inf (what an exploded update leaves), naming how many tensors."""
    state = model.state_dict()
    broken = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        raise NonFiniteWeights(f"{len(broken)} of the {len(state)} weight tensors of {source} hold NaN or inf "
                               f"(first: {broken[0]}): the training diverged; export an earlier checkpoint "
                               "(global_step_N) or train again with a lower learning rate")


def _check_output(out: Path, step_dir: Path) -> Path:
    """Refuse an output inside (or equal to) the checkpoint being read, a checkpoint root, or a folder
    that holds other things than a previous export."""
    resolved, source = out.expanduser().resolve(), step_dir.resolve()
    if resolved == source or source in resolved.parents or resolved in source.parents and \
            CheckpointManager(resolved).step_dirs():
        raise CheckpointError(f"--output {out} is inside or around the checkpoint {step_dir} it exports from; "
                              "export to a folder outside the checkpoint folder")
    if resolved.exists() and (not resolved.is_dir() or (any(resolved.iterdir())
                                                         and not (resolved / "config.json").exists())):
        raise CheckpointError(f"--output {out} exists and is not an exported model folder; choose a new or empty folder")
    return out


def _write_atomically(out: Path, write) -> None:
    """``write(folder)`` into a temporary sibling, then rename it to ``out`` (a previous export is replaced
    only once the new one is complete): a kill or a full disk never leaves a half-written ``out``."""
    import shutil

    parent = out.expanduser().absolute().parent
    tmp = parent / f".tmp_export_{out.name}_{os.getpid()}"
    old = parent / f".old_export_{out.name}_{os.getpid()}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        readable_as_umask_says(tmp)  # save_pretrained's safetensors come out of mkstemp as 0600
        for dirpath, _, names in os.walk(tmp):  # the files of lora_adapter/ too
            for name in names:
                with open(os.path.join(dirpath, name), "rb") as f:
                    os.fsync(f.fileno())
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)  # the previous export stays
        os_err = os_error_of(err)  # safetensors and torch wrap the system's error in their own
        if os_err is None:
            raise
        raise CheckpointWriteError(write_failure_message(
            os_err, parent, f"exporting to {out} failed", f"pass another --output (trainer.default_local_dir for the "
            f"final export); nothing was changed in {out}"), os_err.filename or parent, os_err.errno) from err
    shutil.rmtree(old, ignore_errors=True)


# safetensors' dtype names of the floating types a model may be saved in
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _weights_dtype(source: Path) -> torch.dtype:
    """The floating dtype most weights of ``source`` were saved in (the export keeps the training precision)."""
    counts: dict[torch.dtype, int] = {}
    with open_tensors(source) as file:
        for name in file.keys():
            part = file.get_slice(name)
            dtype = _FLOAT_DTYPES.get(part.get_dtype())
            if dtype is not None:
                counts[dtype] = counts.get(dtype, 0) + math.prod(part.get_shape())
    return max(counts, key=counts.get) if counts else torch.float32


def _load_strict(model: torch.nn.Module, source: Path) -> None:
    """``source``'s tensors read into ``model`` one at a time, strictly: a missing key is forgiven only
    when it is tied to a loaded one. One at a time, and read rather than mapped, because a mapped file
    keeps the pages it was read from until it is closed: a whole file beside the model, which was the
    peak of a run's final export (beside the trainer's state)."""
    target = model.state_dict()
    with open_tensors(source) as file:
        shapes = {k: list(file.get_slice(k).get_shape()) for k in file.keys()}  # the header alone
        names = list(shapes)
        unexpected = [k for k in names if k not in target]
        wrong = [f"{k} {shape} (model: {list(target[k].shape)})" for k, shape in shapes.items()
                 if k in target and shape != list(target[k].shape)]
        shared: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            shared.setdefault(param.data_ptr(), []).append(name)
        tied_to_loaded = {n for tied in shared.values() if any(m in names for m in tied) for n in tied}
        missing = [k for k in target if k not in names and k not in tied_to_loaded]
        if missing or unexpected or wrong:
            raise CheckpointError(f"{source} does not match the model built from its config: "
                                  f"missing {missing[:5]}, unexpected {unexpected[:5]}, shapes {wrong[:5]}")
        with torch.no_grad():
            for name in names:
                target[name].copy_(file.get_tensor(name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain export",
                                     description="Write a checkpoint's actor as a Hugging Face model folder.")
    parser.add_argument("checkpoint", help="global_step_N folder, its actor/ subfolder, or a checkpoint root (latest)")
    parser.add_argument("--output", "-o", required=True, help="folder to write (config, safetensors, tokenizer)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export_actor(args.checkpoint, args.output)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported the actor of {resolve_checkpoint(args.checkpoint)} to {out}")
    return 0


if __name__ == "__main__":
    from posttrain.errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:]))
