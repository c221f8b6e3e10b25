"""A peft LoRA adapter folder on disk (``adapter_config.json`` + ``adapter_model.safetensors``): what
makes one valid. Checked when the config is validated (``lora_adapter_path``), before any model
loads, and again by `posttrain.models.lora` when it loads one; here, on the ground floor (it imports
nothing from posttrain), so that the config checks import neither model nor checkpoint code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["adapter_folder_problem"]


def adapter_folder_problem(path: str) -> str | None:
    """Why ``path`` is not a peft LoRA adapter folder (``adapter_config.json`` with peft_type LORA and
    ``adapter_model.safetensors``), or None."""
    folder = Path(os.path.expanduser(str(path)))
    if not folder.exists():
        return f"{folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is a file, not a peft adapter folder"
    config = folder / "adapter_config.json"
    if not config.is_file():
        return f"{folder} holds no adapter_config.json (not a folder written by peft's save_pretrained)"
    try:
        peft_type = json.loads(config.read_text()).get("peft_type")
    except (OSError, ValueError) as err:
        return f"{config} is not readable JSON ({err})"
    if str(peft_type).upper() != "LORA":
        return f"{config} describes a {peft_type} adapter; only LoRA adapters are supported"
    if not (folder / "adapter_model.safetensors").is_file():
        pickled = [p.name for p in sorted(folder.glob("adapter_model.*")) if p.suffix in (".bin", ".pt", ".pth")]
        if pickled:  # an older peft's format: a pickle, which posttrain does not unpickle (it may run code)
            return (f"{folder} holds {pickled[0]} (a pickle), not adapter_model.safetensors: posttrain loads adapters "
                    "from safetensors only; save the adapter with peft's save_pretrained(safe_serialization=True)")
        return f"{folder} holds no adapter_model.safetensors"
    return None
