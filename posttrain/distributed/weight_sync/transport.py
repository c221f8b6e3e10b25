"""How the trainer's weights travel to the rollout workers: a process group of their own (`WeightSyncGroup`) or
versioned files (`FileWeightSync`), one interface (``send(named_tensors, version)``, ``receive(apply) -> version``).
The package docstring (`posttrain.distributed.weight_sync`) says how each works; `names` says what is sent."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import time
from collections import deque
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from posttrain.errors import PosttrainError

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_TIMEOUT_S", "FileWeightSync", "NamedTensors", "WeightSyncError",
           "WeightSyncGroup"]

DEFAULT_TIMEOUT_S = 600.0
"""How long a join or one collective may wait (verl's ``nccl_timeout`` default, as `fsdp.DEFAULT_TIMEOUT_S`)."""
DEFAULT_BUCKET_BYTES = 256 << 20
"""Bytes per flat broadcast (or safetensors file): large enough that per-call latency is negligible,
small enough that the bucket copy is a fraction of a 0.5 B model."""

_PREFIX = "posttrain-weight-sync"
NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(PosttrainError, RuntimeError):
    """A weight transfer that did not happen: a rank that never joined, a collective that timed out,
    names or shapes that do not match the receiving model, a rollout worker that failed to load."""


class _CollectiveError(WeightSyncError):
    """A collective itself failed: the group cannot be used any more (no abort header is sent)."""


# --------------------------------------------------------------------------- encoding helpers
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"weight sync header names an unknown dtype {name!r}")
    return dtype


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D uint8 view (or copy) of ``t``: every dtype travels as raw bytes, bit-exact
    (gloo has no reduction to apply to a broadcast, but not every dtype is a gloo dtype)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _buckets(named: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``named`` grouped by dtype into lists of about ``bucket_bytes`` (one tensor may exceed it),
    in arrival order; one open bucket per dtype, so memory stays bounded by a bucket per dtype."""
    open_buckets: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"weight sync: {name!r} is a {type(tensor).__name__}, not a tensor")
        bucket = open_buckets.setdefault(tensor.dtype, [])
        bucket.append((name, tensor.detach()))
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + _nbytes(tensor)
        if sizes[tensor.dtype] >= bucket_bytes:
            yield open_buckets.pop(tensor.dtype)
            sizes[tensor.dtype] = 0
    yield from (b for b in open_buckets.values() if b)


def _flatten(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """One uint8 buffer on ``device`` holding the bucket's tensors back to back."""
    parts = [_as_bytes(t.to(device)) for _, t in bucket]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _unflatten(flat: torch.Tensor, dtype: torch.dtype, specs: list) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``flat`` (uint8) for ``specs`` = ``[[name, shape], ...]``."""
    offset = 0
    for name, shape in specs:
        count = 1
        for dim in shape:
            count *= int(dim)
        size = count * dtype.itemsize
        yield name, flat[offset:offset + size].view(dtype).view(shape)
        offset += size
    if offset != flat.numel():
        raise WeightSyncError(f"weight sync bucket holds {flat.numel()} bytes but its header describes {offset}")


# --------------------------------------------------------------------------- the collective group
class WeightSyncGroup:
    """A stateless process group: trainer rank 0 is rank 0, rollout workers are ranks ``1..k``.

    Build it with :meth:`create` on every participant at the same time. ``send`` runs on rank 0,
    ``receive`` on every other rank, concurrently.
    """

    def __init__(self, store: Any, backend_group: Any, *, rank: int, world_size: int, backend: str,
                 device: torch.device, address: str, timeout_s: float):
        self._store, self._pg = store, backend_group
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device, self.address, self.timeout_s = device, address, timeout_s

    # ---------------------------------------------------------------- joining
    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
               timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | str | None = None) -> "WeightSyncGroup":
        """Join the group; returns once all ``world_size`` ranks have joined.

        Rank 0 (the trainer) serves the rendezvous store on ``host:port``; the others connect to it.
        ``backend``: ``gloo`` (CPU tensors) or ``nccl`` (tensors on ``device``, default the current CUDA
        device). Raises `WeightSyncError` naming ``host:port``, the backend and which ranks joined
        when not all of them did within ``timeout_s``.
        """
        if backend not in ("gloo", "nccl"):
            raise WeightSyncError(f"WeightSyncGroup backend={backend!r}: valid backends are 'gloo' (CPU) "
                                  "and 'nccl' (GPU)")
        if world_size < 2 or not 0 <= rank < world_size:
            raise WeightSyncError(f"WeightSyncGroup rank={rank}, world_size={world_size}: the group needs the trainer "
                                  "(rank 0) and at least one rollout worker, and 0 <= rank < world_size")
        address = f"{host}:{port}"
        timeout = datetime.timedelta(seconds=timeout_s)
        deadline = time.monotonic() + timeout_s
        store = dist.PrefixStore(_PREFIX, _connect_store(host, port, rank, world_size, backend, timeout))
        _wait_for_all(store, rank, world_size, deadline, f"{address} ({backend})", timeout_s)
        target = _group_device(backend, device)
        pg = _backend_group(dist.PrefixStore("pg", store), rank, world_size, backend, timeout)
        return cls(store, pg, rank=rank, world_size=world_size, backend=backend, device=target,
                   address=address, timeout_s=timeout_s)

    def barrier(self) -> None:
        """Wait until every rank of the group reaches this call (one small all-reduce)."""
        self._status(0)

    def close(self) -> None:
        """Tear the group down (NCCL communicators are shut down; the store closes with rank 0's object)."""
        if self._pg is not None and self.backend == "nccl":  # frees the communicator now, not at exit
            shutdown = getattr(self._pg, "shutdown", None) or getattr(self._pg, "_shutdown")
            shutdown()
        self._pg = None
        self._store = None

    # ---------------------------------------------------------------- sending
    def send(self, named_tensors: NamedTensors, version: int, *,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
        """Broadcast ``named_tensors`` (consumed once, lazily) to every rollout worker as ``version``.

        Returns ``weight_sync/{seconds,bytes,version,tensors,buckets}``; ``seconds`` runs until every
        receiver has applied the weights. Raises `WeightSyncError` naming each rank that failed.
        """
        self._require(self.rank == 0, "send")
        start, sent, count, buckets = time.perf_counter(), 0, 0, 0
        in_flight: tuple[Any, torch.Tensor] | None = None  # one broadcast runs while the next bucket is built
        try:
            for bucket in _buckets(named_tensors, bucket_bytes):
                flat = _flatten(bucket, self.device)
                header = {"version": version, "dtype": _dtype_name(bucket[0][1].dtype),
                          "tensors": [[name, list(t.shape)] for name, t in bucket], "bytes": flat.numel()}
                in_flight = self._finish(in_flight)
                self._send_header(header)
                in_flight = (self._broadcast(flat, wait=False), flat)
                sent, count, buckets = sent + flat.numel(), count + len(bucket), buckets + 1
                del flat, bucket
            in_flight = self._finish(in_flight)
        except _CollectiveError:
            raise
        except Exception as err:  # the trainer's own tensors failed: receivers are told, then everyone stops
            self._finish(in_flight)
            self._send_header({"version": version, "error": f"{type(err).__name__}: {err}"})
            self._status(0)
            raise
        self._send_header({"version": version, "end": True, "tensors": count})
        self._raise_for_receivers(version, self._status(0))
        return {"weight_sync/seconds": time.perf_counter() - start, "weight_sync/bytes": float(sent),
                "weight_sync/version": float(version), "weight_sync/tensors": float(count),
                "weight_sync/buckets": float(buckets)}

    def _raise_for_receivers(self, version: int, failed: int) -> None:
        if not failed:
            return
        messages = []
        for rank in range(1, self.world_size):
            key = f"error/{version}/{rank}"
            if self._store.check([key]):
                messages.append(f"rank {rank}: {self._store.get(key).decode()}")
                self._store.delete_key(key)
        raise WeightSyncError(f"weight sync version {version} over {self.address} ({self.backend}) failed on "
                              f"{len(messages)} rollout worker(s): " + "; ".join(messages))

    # ---------------------------------------------------------------- receiving
    def receive(self, apply: Callable[[Iterator[tuple[str, torch.Tensor]]], Any]) -> int:
        """Receive one version: ``apply`` gets an iterator of ``(name, tensor)`` (views into the
        received bucket, on this group's device; each bucket is a fresh buffer, so ``apply`` may keep
        them) and must consume all of it. Returns the version.

        When ``apply`` raises (or leaves tensors unconsumed) the rest of the transfer is still
        received, the error is reported to the trainer, and a `WeightSyncError` is raised here.
        """
        self._require(self.rank != 0, "receive")
        incoming = _Incoming(self, self._receive_header())
        error = None
        try:
            apply(iter(incoming))
        except _CollectiveError:
            raise
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        left = incoming.drain()
        if incoming.sender_error:
            self._status(1)
            raise WeightSyncError(f"weight sync version {incoming.version}: the trainer failed while sending: "
                                  f"{incoming.sender_error}")
        if error is None and left:
            error = f"apply left {len(left)} received tensor(s) unconsumed, the first {left[0]!r}"
        if error is not None:
            self._store.set(f"error/{incoming.version}/{self.rank}", error)
        self._status(1 if error else 0)
        if error is not None:
            raise WeightSyncError(f"weight sync version {incoming.version} over {self.address}: {error}")
        return incoming.version

    # ---------------------------------------------------------------- collectives
    def _require(self, ok: bool, what: str) -> None:
        if not ok:
            side = "rank 0 (the trainer)" if what == "send" else "ranks 1.. (rollout workers)"
            raise WeightSyncError(f"WeightSyncGroup.{what} runs on {side}; this is rank {self.rank}")

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except Exception as err:
            raise _CollectiveError(f"weight sync {what} over {self.address} ({self.backend}, rank {self.rank} of "
                                   f"{self.world_size}) failed or timed out after {self.timeout_s:g} s: {err}") from err

    def _broadcast(self, tensor: torch.Tensor, wait: bool = True) -> Any:
        """Broadcast from rank 0 into ``tensor``; ``wait=False`` returns the running work (or None)."""
        if tensor.numel() == 0:  # a bucket of empty tensors: nothing to move
            return None
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self._pg.broadcast([tensor], options)
        if not wait:
            return work
        self._wait(work, "broadcast")
        return None

    def _finish(self, in_flight: tuple[Any, torch.Tensor] | None) -> None:
        """Wait for a broadcast started with ``wait=False`` (its tensor is kept alive until then)."""
        if in_flight is not None and in_flight[0] is not None:
            self._wait(in_flight[0], "broadcast")

    def _send_header(self, header: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(self.device)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(data)

    def _receive_header(self) -> dict:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length)
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(data)
        return json.loads(bytes(data.cpu().numpy()).decode())

    def _receive_bucket(self, nbytes: int) -> torch.Tensor:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(flat)
        return flat

    def _status(self, failed: int) -> int:
        """All ranks: the largest ``failed`` flag (0 ok, 1 failed), after each receiver recorded its error."""
        flag = torch.tensor([failed], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self._wait(self._pg.allreduce([flag], options), "status all-reduce")
        return int(flag.item())


class _Incoming:
    """The receiver's side of one version: yields tensors bucket by bucket as they arrive."""

    def __init__(self, group: WeightSyncGroup, first: dict):
        self._group, self._pending = group, deque()
        self.version = int(first["version"])
        self._header: dict | None = first
        self.done, self.sender_error, self.received = False, None, 0

    def __iter__(self) -> "_Incoming":
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        while not self._pending:
            if self.done:
                raise StopIteration
            self._next_bucket()
        self.received += 1
        return self._pending.popleft()

    def _next_bucket(self) -> None:
        header = self._header if self._header is not None else self._group._receive_header()
        self._header = None
        if int(header["version"]) != self.version:
            raise WeightSyncError(f"weight sync: a header of version {header['version']} inside version {self.version}")
        if "error" in header:
            self.done, self.sender_error = True, header["error"]
        elif header.get("end"):
            self.done = True
            if int(header["tensors"]) != self.received + len(self._pending):
                raise WeightSyncError(f"weight sync version {self.version}: the trainer sent {header['tensors']} "
                                      f"tensors, {self.received + len(self._pending)} arrived")
        else:
            flat = self._group._receive_bucket(int(header["bytes"]))
            self._pending.extend(_unflatten(flat, _dtype(header["dtype"]), header["tensors"]))

    def drain(self) -> list[str]:
        """Receive the rest of this version; the names of tensors ``apply`` did not take."""
        before = self.received
        left = [name for name, _ in self]
        self.received = before
        return left


def _connect_store(host: str, port: int, rank: int, world_size: int, backend: str,
                   timeout: datetime.timedelta) -> dist.Store:
    """Rank 0 serves the rendezvous store, the others connect (retrying until ``timeout``)."""
    try:
        return dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    except Exception as err:
        role = "could not serve" if rank == 0 else "could not reach"
        hint = ("is the port in use?" if rank == 0 else
                "rank 0 (trainer rank 0) serves it: did it start, with this host and port?")
        raise WeightSyncError(f"WeightSyncGroup ({backend}): rank {rank} {role} the rendezvous store at {host}:{port} "
                              f"within {timeout.total_seconds():g} s, so 0 of {world_size} ranks joined as far as "
                              f"this rank can tell; {hint} ({type(err).__name__}: {err})") from err


def _wait_for_all(store: dist.Store, rank: int, world_size: int, deadline: float, where: str, timeout_s: float) -> None:
    """Mark this rank joined, then wait (polling the store) until every rank has."""
    store.set(f"joined/{rank}", "1")
    keys = [f"joined/{r}" for r in range(world_size)]
    while not store.check(keys):
        if time.monotonic() > deadline:
            joined = [r for r in range(world_size) if store.check([keys[r]])]
            missing = [r for r in range(world_size) if r not in joined]
            raise WeightSyncError(f"WeightSyncGroup at {where}: {len(joined)} of {world_size} ranks joined within "
                                  f"{timeout_s:g} s (joined {joined}, missing {missing}; rank 0 is the trainer, "
                                  "ranks 1.. the rollout workers)")
        time.sleep(0.02)


def _group_device(backend: str, device: torch.device | str | None) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    if device is not None:
        return torch.device(device)
    if not torch.cuda.is_available():
        raise WeightSyncError("WeightSyncGroup backend='nccl' needs a CUDA device; use backend='gloo' on CPU")
    return torch.device("cuda", torch.cuda.current_device())


def _backend_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout: datetime.timedelta) -> Any:
    """torch's gloo or NCCL backend constructed straight from a store (no default group needed)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise WeightSyncError("WeightSyncGroup backend='nccl': this torch build has no NCCL (a CPU build?)")
    return nccl(store, rank, world_size, timeout)


# --------------------------------------------------------------------------- files
class FileWeightSync:
    """Weights through a folder both sides can see: ``folder/v<version>/`` holds safetensors files of
    about ``bucket_bytes`` each and a ``manifest.json`` (names, dtypes, shapes, file of every tensor);
    ``folder/version`` names the newest complete version and is replaced atomically (written to a
    temporary name, then renamed) only after its folder is complete. The newest ``keep`` versions
    are kept; older ones are deleted by the sender.
    """

    VERSION_FILE = "version"

    def __init__(self, folder: str | os.PathLike, *, keep: int = 2, poll_s: float = 0.05):
        self.folder = Path(folder)
        self.keep, self.poll_s = max(1, int(keep)), poll_s
        self.version = -1
        """The last version this object sent or received; :meth:`receive` waits for a newer one."""

    def _version_dir(self, version: int) -> Path:
        return self.folder / f"v{version:08d}"

    def send(self, named_tensors: NamedTensors, version: int, *,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
        """Write ``named_tensors`` as ``version``; returns the same metrics as `WeightSyncGroup.send`."""
        start = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self._version_dir(version)
        tmp = self.folder / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            manifest, sent = _write_parts(tmp, named_tensors, bucket_bytes)
            (tmp / "manifest.json").write_text(json.dumps({"version": version, "tensors": manifest}))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _write_atomically(self.folder / self.VERSION_FILE, f"{version}\n")
        self.version = version
        self._clean_up(version)
        return {"weight_sync/seconds": time.perf_counter() - start, "weight_sync/bytes": float(sent),
                "weight_sync/version": float(version), "weight_sync/tensors": float(len(manifest)),
                "weight_sync/buckets": float(len({entry[3] for entry in manifest}))}

    def _clean_up(self, newest: int) -> None:
        """Delete version folders older than the newest ``keep`` (a reader opened its files first)."""
        versions = sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := re.fullmatch(r"v(\d+)", p.name)))
        for old in [v for v in versions if v <= newest][:-self.keep]:
            shutil.rmtree(self._version_dir(old), ignore_errors=True)

    def latest(self) -> int | None:
        """The newest complete version in the folder, or None."""
        try:
            return int((self.folder / self.VERSION_FILE).read_text().strip())
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise WeightSyncError(f"{self.folder / self.VERSION_FILE}: not a version number ({err})") from err

    def receive(self, apply: Callable[[Iterator[tuple[str, torch.Tensor]]], Any], *,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
        """Wait (up to ``timeout_s``) for a version newer than :attr:`version`, check its files against
        its manifest, and pass its tensors to ``apply``; returns that version."""
        deadline = time.monotonic() + timeout_s
        while True:
            latest = self.latest()
            if latest is not None and latest > self.version:
                break
            if time.monotonic() > deadline:
                raise WeightSyncError(f"{self.folder}: no weight version newer than {self.version} within "
                                      f"{timeout_s:g} s (newest: {latest})")
            time.sleep(self.poll_s)
        with ExitStack() as stack:
            latest, files, names = self._open_version(latest, stack)
            apply(((name, files[name].get_tensor(name)) for name in names))
        self.version = latest
        return latest

    def _open_version(self, latest: int, stack: ExitStack) -> tuple[int, dict[str, Any], list[str]]:
        """Open every file of version ``latest`` and check them against its manifest; when the sender
        deleted that version meanwhile (``keep`` newer ones written), the newest one instead."""
        while True:
            folder = self._version_dir(latest)
            files = _open_parts(folder, stack)
            if folder.is_dir():  # still there after opening: the open files stay readable from now on
                return latest, files, [entry[0] for entry in _read_manifest(folder, files)]
            newest = self.latest()
            if newest is None or newest <= latest:
                raise WeightSyncError(f"{folder}: the version file names it but the folder is gone")
            latest = newest


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_parts(folder: Path, named: NamedTensors, bucket_bytes: int) -> tuple[list, int]:
    """safetensors files ``part-NNNNN.safetensors`` of about ``bucket_bytes`` each; returns the manifest
    rows ``[name, dtype, shape, file]`` and the bytes written."""
    from safetensors.torch import save_file

    manifest: list = []
    part: dict[str, torch.Tensor] = {}
    names: set[str] = set()
    size = total = files = 0
    for name, tensor in named:
        if name in names:
            raise WeightSyncError(f"FileWeightSync: {name!r} sent twice in one version")
        names.add(name)
        t = tensor.detach().cpu().contiguous()
        if any(t.data_ptr() == other.data_ptr() for other in part.values()):
            t = t.clone()  # safetensors refuses two names on one storage in a file (tied twins)
        part[name] = t
        manifest.append([name, _dtype_name(t.dtype), list(t.shape), f"part-{files:05d}.safetensors"])
        size, total = size + _nbytes(t), total + _nbytes(t)
        if size >= bucket_bytes:
            save_file(part, str(folder / manifest[-1][3]))
            part, size, files = {}, 0, files + 1
    if part:
        save_file(part, str(folder / manifest[-1][3]))
    return manifest, total


def _open_parts(folder: Path, stack: ExitStack) -> dict[str, Any]:
    """Every part file of a version opened (a later clean-up cannot pull it away); name -> handle."""
    from safetensors import safe_open

    handles: dict[str, Any] = {}
    for path in sorted(folder.glob("part-*.safetensors")):
        handle = stack.enter_context(safe_open(str(path), framework="pt"))
        handles.update({name: handle for name in handle.keys()})
    return handles


def _read_manifest(folder: Path, files: dict[str, Any]) -> list:
    """The manifest, checked against the files: every tensor present with its shape, nothing extra."""
    path = folder / "manifest.json"
    try:
        manifest = json.loads(path.read_text())["tensors"]
    except (OSError, ValueError, KeyError) as err:
        raise WeightSyncError(f"{path}: missing or unreadable ({err})") from err
    for name, _, shape, part in manifest:
        if name not in files:
            raise WeightSyncError(f"{folder}: the manifest lists {name!r} (in {part}) but no file holds it")
        found = list(files[name].get_slice(name).get_shape())
        if found != list(shape):
            raise WeightSyncError(f"{folder}/{part}: {name!r} has shape {found}, the manifest says {shape}")
    extra = sorted(set(files) - {row[0] for row in manifest})
    if extra:
        raise WeightSyncError(f"{folder}: the files hold {extra[0]!r} ({len(extra)} in all) that the manifest lacks")
    return manifest


# --------------------------------------------------------------------------- what the trainer sends
