"""A folder given where a model is expected, recognised as a checkpoint: what it holds and what to do instead.

`posttrain eval` reads checkpoints itself; `train`, `serve`, `plan` and `prep pairs` take Hugging Face model
folders, and a checkpoint root given to them is named as one, with `posttrain export` (or the run's final
``hf_model/``), instead of "a folder without config.json".
"""

from __future__ import annotations

from pathlib import Path

from posttrain.checkpoint.layout import CheckpointManager, checkpoint_problem, is_step_dir_name

__all__ = ["checkpoint_found"]


def checkpoint_found(folder: Path) -> str | None:
    """What ``folder`` (without config.json) holds when it is a posttrain checkpoint (a root of
    ``global_step_N`` folders, one of them, or its ``actor/``) or a finished run's folder (``hf_model/``), said
    with the model folder to use or the command that writes one; None for any other folder."""
    exported = folder / "hf_model"
    if (exported / "config.json").is_file():
        return f"{folder} is a run's checkpoint folder, not a model folder; the run's final model is {exported}"
    if folder.name == "actor" and is_step_dir_name(folder.parent.name):
        steps = [folder.parent]
    else:
        steps = [folder] if is_step_dir_name(folder.name) else CheckpointManager(folder).step_dirs()
    if not steps:
        return None
    complete = [step for step in steps if checkpoint_problem(step) is None]
    if not complete:
        return (f"{folder} is a posttrain checkpoint, not a Hugging Face model folder, and holds no complete one "
                f"({checkpoint_problem(steps[-1])})")
    return (f"{folder} is a posttrain checkpoint ({complete[-1].name}), not a Hugging Face model folder; "
            f"`posttrain export {folder} --output DIR` writes one from its actor")
