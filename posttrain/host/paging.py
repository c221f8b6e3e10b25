"""State paged to a file between uses: what verl's ``param_offload`` / ``optimizer_offload`` do on a CPU run.

On a GPU those keys keep a role's state in CPU memory outside the phase that uses it. On a CPU the
device's memory *is* the machine's, so there is nowhere in memory to move it to; the next tier down
is a file. `PagedTensors` lays tensors out in one unlinked file mapped into the process
(``MAP_SHARED``): using them is using memory, and `PagedTensors.page_out` then drops their pages from
the process (``madvise(MADV_DONTNEED)``). What was written stays in the kernel's page cache, which is
reclaimable: while memory is free the next use maps the pages straight back (a minor fault per page,
a pass about as fast as over ordinary memory: benchmarks/README.md, "Host"), and under memory
pressure the kernel writes them to the file and frees them instead of the process running out of
memory.

Used for the frozen reference's and reward model's weights (``actor_rollout_ref.ref.fsdp_config.
param_offload``, ``reward_model.model.fsdp_config.param_offload``: paged out after each pass) and for
AdamW's moments (``*.fsdp_config.optimizer_offload``: `posttrain.optim.paged.PagedAdamW` pages each parameter's moments out
right after its update). The one-process placement (`posttrain.distributed.placement.InProcess`) decides both.
The file lives in the temporary directory (``TMPDIR``), which must be on a disk: paging to a
``tmpfs`` would move the memory, not free it, so that is refused with an error that says so.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from posttrain.errors import ConfigError

__all__ = ["PAGED_WEIGHTS_ATTR", "PagedTensors", "offload_directory", "one_pass", "page_module",
           "page_out_after_each_layer", "paged_weights",
           "paging_directory"]

PAGE = mmap.PAGESIZE
IN_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
PAGED_WEIGHTS_ATTR = "posttrain_paged_weights"
"""Attribute `page_module` sets on the module: the `PagedTensors` its weights now live in."""


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // PAGE) * PAGE


def _filesystem_type(path: str) -> str | None:
    """The type of the filesystem holding ``path`` (its longest mount point in /proc/mounts), None off Linux."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return None
    return kind


def paging_directory(key: str, directory: str | None = None) -> str:
    """Where ``key``'s state is paged to: ``directory``, else the temporary directory (``TMPDIR``);
    ConfigError when that is an in-memory filesystem, where paging would free nothing."""
    directory = directory or tempfile.gettempdir()
    kind = _filesystem_type(directory)
    if kind in IN_MEMORY_FILESYSTEMS:
        raise ConfigError(
            f"{key}=True on a CPU run pages that state to a file in {directory}, which is a {kind} (held in "
            f"memory), so paging would free no memory: set TMPDIR to a directory on a disk, or {key}=False")
    return directory


class PagedTensors:
    """Tensors shaped and typed like ``like``, laid out page-aligned in one unlinked file mapped into this
    process. ``tensors[i]`` starts as zeros; `page_out` drops their pages from this process's memory
    (the contents stay: in the page cache, or in the file once the kernel writes them out).

    The file's blocks are reserved on creation (``posix_fallocate``), so a full disk is an error here
    rather than a ``SIGBUS`` at the first write the kernel cannot place; the file has no name, so
    nothing is left behind when the process ends, however it ends.
    """

    def __init__(self, like: Sequence[torch.Tensor], directory: str, what: str = "state"):
        self._spans: list[tuple[int, int]] = []  # (offset, bytes) of each tensor in the file
        offset = 0
        for t in like:
            nbytes = t.numel() * t.element_size()
            self._spans.append((offset, nbytes))
            offset += _pages(nbytes)
        self.nbytes = max(offset, PAGE)
        self._file = tempfile.TemporaryFile(dir=directory, prefix="posttrain-paged-")
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._file.fileno(), 0, self.nbytes)
            else:  # macOS: sized, not reserved
                self._file.truncate(self.nbytes)
        except OSError as e:
            self._file.close()
            raise OSError(e.errno, f"cannot reserve {self.nbytes / 1e9:.2f} GB in {directory} to page {what} "
                                   f"to disk: {e.strerror}; free space there or set TMPDIR elsewhere") from None
        self._map = mmap.mmap(self._file.fileno(), self.nbytes)  # MAP_SHARED: writes reach the file
        self.tensors = [
            torch.frombuffer(self._map, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
            if t.numel() else torch.empty(t.shape, dtype=t.dtype)
            for t, (off, _) in zip(like, self._spans)]

    def page_out(self, index: int | None = None) -> None:
        """Drop tensor ``index``'s pages (all tensors' when None) from this process's memory."""
        if index is None:
            self._map.madvise(mmap.MADV_DONTNEED, 0, self.nbytes)
            return
        offset, nbytes = self._spans[index]
        if nbytes:
            self._map.madvise(mmap.MADV_DONTNEED, offset, _pages(nbytes))

    def holds(self, index: int, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is ``tensors[index]`` itself (same memory), not a copy elsewhere."""
        mine = self.tensors[index]
        return tensor.data_ptr() == mine.data_ptr() and tensor.shape == mine.shape

    def store(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` copied into ``tensors[index]`` (unless it is that tensor already: a checkpoint load puts
        copies elsewhere), which is then paged out and returned: the caller keeps it in place of ``tensor``."""
        if not self.holds(index, tensor):
            self.tensors[index].copy_(tensor)
        self.page_out(index)
        return self.tensors[index]


def page_module(module: nn.Module, directory: str, what: str = "the reference's weights") -> PagedTensors:
    """``module``'s parameters (each once, tied ones too) moved into a `PagedTensors` and paged out;
    the module computes as before, touching its weights pages them back in (`paged_weights` finds
    them again, for `one_pass`)."""
    params = list({id(p): p for p in module.parameters()}.values())
    paged = PagedTensors([p.detach() for p in params], directory, what=what)
    with torch.no_grad():
        for p, slot in zip(params, paged.tensors):
            slot.copy_(p)
            p.data = slot
    paged.page_out()
    object.__setattr__(module, PAGED_WEIGHTS_ATTR, paged)
    return paged


def page_out_after_each_layer(module: nn.Module, layers: Sequence[nn.Module]) -> None:
    """After each of ``layers`` (``module``'s decoder layers) has run, its weights are dropped from memory
    again, so a pass over a paged module (`page_module`) holds one layer's weights at a time instead of all
    of them (the embeddings and the output layer stay until `one_pass` ends). A layer run twice (a shared
    prompt, then the responses) maps its weights back from the page cache: minor faults, no disk."""
    paged = paged_weights(module)
    if paged is None:
        return
    slot = {id(p): i for i, p in enumerate({id(p): p for p in module.parameters()}.values())}  # page_module's order

    def drop(indices: list[int]):
        def hook(*_: Any) -> None:  # returns None: the layer's output stays as it is
            for i in indices:
                paged.page_out(i)
        return hook

    for layer in layers:
        layer.register_forward_hook(drop([slot[id(p)] for p in layer.parameters() if id(p) in slot]))


def paged_weights(module: nn.Module | None) -> PagedTensors | None:
    """The file `page_module` moved ``module``'s weights into; None when they are ordinary memory."""
    return getattr(module, PAGED_WEIGHTS_ATTR, None)


@contextlib.contextmanager
def one_pass(paged: PagedTensors | None) -> Iterator[None]:
    """One pass over a paged module's weights (`page_module`): paged out after it, however it ends;
    nothing to do when ``paged`` is None (the weights are ordinary memory)."""
    try:
        yield
    finally:
        if paged is not None:
            paged.page_out()


def offload_directory(fsdp_config: Any, key: str, section: str, module: nn.Module,
                      device: torch.device) -> str | None:
    """Where to page a role's state when ``<section>.fsdp_config.<key>`` (``param_offload`` /
    ``optimizer_offload``) asks for offload in a one-process CPU run; None otherwise: the key is off,
    the device is a GPU (the state moves to CPU memory, `posttrain.distributed.fsdp`), or the module is
    FSDP-sharded on ranks (where offload on CPU keeps the state where it is)."""
    if not bool(getattr(fsdp_config, key, False)) or torch.device(device).type != "cpu":
        return None
    if getattr(module, "posttrain_fsdp", None) is not None:
        return None
    return paging_directory(f"{section}.fsdp_config.{key}")
