"""The optimizer room: which optimizer a role trains with, how it is built, and posttrain's own ones.

    build.py      names (verl's, transformers' and TRL's), verl's optim.optimizer_impl seam, the lr schedules,
                  `build_optimizer`
    adamw8bit.py  AdamW with 8-bit block-wise moments (the CPU default), its block update in C
    adamw8bit.c   that update: one pass per block of 256 values, OpenMP over blocks
    native.py     C kernels built once per machine with the system's compiler, checked and loaded with ctypes
    paged.py      float32 AdamW whose moments live in a file between uses (optimizer_offload on a CPU run)

A ground-floor room: it imports torch, `posttrain.host` (cache folder, paging) and `posttrain.errors`, never a
role, a model or the config. Which optimizer a run gets (``optim.optimizer: auto``) is the placement's choice
(`posttrain.host.memory_plan`); building it is this room's.
"""

from posttrain.optim.build import (OPTIMIZER_NAMES, build_lr_scheduler, build_optimizer, optimizer_kind,
                                   trainable_parameters)

__all__ = ["OPTIMIZER_NAMES", "build_lr_scheduler", "build_optimizer", "optimizer_kind", "trainable_parameters"]
