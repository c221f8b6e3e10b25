"""The host room: levers on the process and the machine it runs on, not on the model's math.

    threads.py    OpenMP threads that spin on idle cores and sleep on shared ones (set before torch loads)
    allocator.py  glibc's malloc told to keep freed memory for reuse, and when to hand it back
    paging.py     state paged to a file between uses (param_offload / optimizer_offload on a CPU run)
    resident.py   resident memory now, at its peak and per phase
    cache.py      the per-user cache folder and per-machine answers (timings measured once)
    cpu.py        what this CPU computes in (bf16 instructions or not)
    disk.py       failed writes (full disk, quota, read-only) as one error naming the file

The optimizers (8-bit AdamW and its C kernel, the paged AdamW) are `posttrain.optim`'s; the one-process
placement where these levers meet the roles (`InProcess`) is `posttrain.distributed.placement`, beside the ranks'.

They live apart so that the roles (`posttrain.workers`) read as the same code on a GPU and on a CPU:
a role receives a placed module and its optimizer and never decides paging, the allocator or
compiled layers (`posttrain.workers` never imports this package). This file imports nothing: the
thread settings must be importable before torch loads.
"""
