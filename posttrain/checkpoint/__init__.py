"""Storage on the ground floor: checkpoints of a run and of each role, written atomically and
loaded without executing code. Nothing here imports workers or distributed placement.

    layout  the run's checkpoint folders (verl's layout), atomic saves, the manifest, safe loads,
            RNG state; `CheckpointManager` (everything this package's root exports comes from here)
    role    one role's state (weights, optimizer, lr schedule, shuffle generator, LoRA records):
            `save_role` / `load_role_into`, in one process or sharded over ranks
    dcp     sharded state with ``torch.distributed.checkpoint`` (any world size, trainable-only
            option, a metadata reader that never unpickles code)
    ranks   this process's rank and whether a module's state is per-rank (FSDP2)
    rank_rng  each rank's random state (``rng/rank_<r>.pt``) and what a resume at another world
            size reseeds
"""

from posttrain.checkpoint import layout
from posttrain.checkpoint.layout import (
    EXTRA_FILE,
    FINGERPRINT_KEY,
    GENERATOR_FILE,
    HF_DIR,
    MARKER,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TRACKER,
    CheckpointError,
    CheckpointWriteError,
    CheckpointManager,
    LoadedCheckpoint,
    RoleState,
    _seal,
    capture_rng,
    check_weights_fit,
    checkpoint_problem,
    is_step_dir_name,
    load_checkpoint,
    load_role,
    read_run_state,
    restore_rng,
    safe_torch_load,
    verify_checkpoint,
    write_role,
)

__all__ = list(layout.__all__)  # the root exports the layout's public names
