"""`AdamW8bit`: AdamW with its two moments stored in 8 bits, block by block (2 bytes a parameter
instead of 8: 0.27 GB instead of 1.08 GB for SmolLM2-135M).

Why not bitsandbytes: bitsandbytes 0.50.2 installs and runs on this CPU (AVX2), but its CPU step
took 1.0-1.2 s for one ``[49152 * 576]`` parameter against fused AdamW's 0.03 s (x40; ~4.7 s a
step for the 134.5M parameters of SmolLM2), more than the run's whole step-time allowance. Here a
parameter's blocks are updated by ``adamw8bit.c`` (one pass a block of 256 values, in L1; built once
per machine by `posttrain.optim.native`): 0.09-0.10 s for 56M values against 0.29-0.31 s for the same
arithmetic in torch ops (`_update_blocks`, ~20 passes over chunks that stay in cache), which runs where no
C compiler builds the kernel. The two agree but where torch's sqrt (MKL's, within an ulp, not correctly
rounded) tips a code by one level (figures: benchmarks/README.md, "Memory").

The format (after Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", and Li et
al. 2023, "Memory Efficient Optimizers with 4-bit States"): each parameter's moments are cut into
blocks of ``BLOCK`` (256) values; a block stores one float32 scale and one byte per value.

- first moment ``m``: signed, companded by a square root, ``q = round(127 * sign(m) * sqrt(|m| / max|m|))``,
  read back as ``m = max|m| * q * |q| / 127^2``: the smallest non-zero value is 1/16129 of the block's
  largest (a linear code's is 1/127, and the many small moments of a block would read back as 0);
- second moment ``v``: stored as its fourth root ``r = v^(1/4)``, linear and without a zero,
  ``q = round(256 * r / max r) - 1`` in 0..255, read back as ``r = max r * (q + 1) / 256``: a value can
  only read back *larger* (never 0), so ``m / sqrt(v)`` cannot blow up on a rounded-down denominator
  (Li et al.'s zero-point problem); the smallest ``sqrt(v)`` is 1/65536 of the block's largest.

Parameters with fewer than ``MIN_8BIT_SIZE`` (4096) values (norms, biases) keep float32 moments, as
bitsandbytes does: they are a rounding error of the total and the most sensitive to it.
The update is AdamW's (decoupled weight decay, bias correction); ``tests/optim/test_adamw8bit.py`` holds it
against a float64 AdamW on a small problem.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from typing import Iterable

import torch

__all__ = ["AdamW8bit", "BLOCK", "MIN_8BIT_SIZE", "state_bytes"]

BLOCK = 256
MIN_8BIT_SIZE = 4096
CHUNK_BLOCKS = 2048  # blocks updated at once: 512K values, a few 2 MiB temporaries that stay in cache


class AdamW8bit(torch.optim.Optimizer):
    """AdamW (``lr``, ``betas``, ``eps``, ``weight_decay`` as torch's) with 8-bit block-wise moments."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, directory: str | None = None,
                 native: bool | None = None):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW8bit: lr, eps and weight_decay must be >= 0 and betas in [0, 1), got "
                             f"lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._paged = None if directory is None else _PagedCodes(self._params_8bit(), directory)
        self._native = _native_kernel(native) if self._params_8bit() else None
        self.kernel = "C" if self._native is not None else "torch"
        """What updates the 8-bit blocks: ``C`` (``adamw8bit.c``, one pass a block) or ``torch`` (`_update_blocks`)."""

    def _params_8bit(self) -> list[torch.Tensor]:
        """The parameters whose moments are stored in 8 bits (each once), in group order."""
        seen: dict[int, torch.Tensor] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.numel() >= MIN_8BIT_SIZE:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not take sparse gradients")
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            _init_state(state, p, self._paged)
        native = ("exp_avg" not in state and self._native is not None and _plain_cpu_float32(p)
                  and _plain_cpu_float32(p.grad))
        if native:
            _check_sizes(p, state)  # before anything changes
        state["step"] += 1
        step = int(state["step"])
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        if wd:
            p.mul_(1 - lr * wd)
        bias1, bias2_sqrt = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
        if "exp_avg" in state:  # a small parameter: float32 moments, torch's AdamW arithmetic
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            p.addcdiv_(m, v.sqrt().div_(bias2_sqrt).add_(eps), value=-lr / bias1)
            return
        if native:
            _update_native(self._native, p, p.grad, state, beta1, beta2, eps, lr / bias1, bias2_sqrt)
        else:
            _update_blocks(p, p.grad, state, beta1, beta2, eps, lr / bias1, bias2_sqrt)
        if self._paged is not None:
            self._paged.page_out(p, state)

    def page_out(self) -> None:
        """Every paged code dropped from memory (after a checkpoint read them all); nothing when not paged."""
        if self._paged is not None:
            self._paged.file.page_out()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load of everything but the codes, which are put back as they were saved, then (when paged)
        moved into the file and paged out. torch casts every loaded state tensor to its parameter's dtype: the
        int8 codes of every parameter would be float32 at once (4x their memory: a resumed run's peak), and
        ``.float()`` in the update would alias them instead of copying."""
        held_back, rest = {}, {}
        for pid, saved in state_dict["state"].items():
            held_back[pid] = {k: v for k, v in saved.items() if k in CODE_KEYS}
            rest[pid] = {k: v for k, v in saved.items() if k not in CODE_KEYS}
        super().load_state_dict({**state_dict, "state": rest})
        params = {pid: p for saved, group in zip(state_dict["param_groups"], self.param_groups)
                  for pid, p in zip(saved["params"], group["params"])}
        for pid, codes in held_back.items():
            if not codes:
                continue
            p = params[pid]
            state = self.state[p]
            for key, (_, dtype) in zip(CODE_KEYS, _code_shapes(p)):
                state[key] = codes[key].to(device=p.device, dtype=dtype)  # exact: whole numbers in the dtype's range
            if self._paged is not None:
                self._paged.page_out(p, state)


CODE_KEYS = ("exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")
"""A large parameter's state tensors besides its step counter."""


def _code_shapes(p: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of ``p``'s `CODE_KEYS` tensors, in that order."""
    blocks = -(-p.numel() // BLOCK)
    return [((blocks, BLOCK), torch.int8), ((blocks,), torch.float32), ((blocks, BLOCK), torch.uint8),
            ((blocks,), torch.float32)]


class _PagedCodes:
    """The 8-bit codes and scales of ``params`` in one file paged out of memory between steps
    (`posttrain.host.paging.PagedTensors`): a parameter's codes are in memory only while its own update
    runs, so the forward and backward that precede the optimizer step do not hold them (0.27 GB for
    SmolLM2-135M). Their pages stay in the kernel's page cache while memory is free."""

    def __init__(self, params: list[torch.Tensor], directory: str):
        from posttrain.host.paging import PagedTensors  # noqa: PLC0415 - host's one file-backed store

        self.params = params
        like = [torch.empty(shape, dtype=dtype, device="meta") for p in params for shape, dtype in _code_shapes(p)]
        self.file = PagedTensors(like, directory, what="AdamW's 8-bit moments")
        self._first = {p: i * len(CODE_KEYS) for i, p in enumerate(params)}

    def slots(self, p: torch.Tensor) -> list[torch.Tensor]:
        """``p``'s `CODE_KEYS` tensors in the file (zeros until written)."""
        first = self._first[p]
        return self.file.tensors[first:first + len(CODE_KEYS)]

    def page_out(self, p: torch.Tensor, state: dict) -> None:
        """``p``'s codes moved into the file (when a checkpoint load put copies elsewhere) and dropped from memory."""
        first = self._first[p]
        for k, key in enumerate(CODE_KEYS):
            state[key] = self.file.store(first + k, state[key])


def _init_state(state: dict, p: torch.Tensor, paged: _PagedCodes | None = None) -> None:
    state["step"] = torch.tensor(0.0)
    if p.numel() < MIN_8BIT_SIZE:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return
    if not p.is_contiguous():
        raise ValueError(f"AdamW8bit needs contiguous parameters; got one of shape {tuple(p.shape)} with strides "
                         f"{p.stride()}")
    if paged is not None:  # the file starts as zeros
        state.update(zip(CODE_KEYS, paged.slots(p)))
        return
    for key, (shape, dtype) in zip(CODE_KEYS, _code_shapes(p)):
        state[key] = torch.zeros(shape, dtype=dtype, device=p.device)


def _native_kernel(native: bool | None):
    """``adamw8bit.c``'s ``adamw8bit_update`` (`posttrain.optim.native`), or None: ``native=False``, or no C
    compiler (auto warns once and keeps the torch update, the same arithmetic ~3x slower; True raises)."""
    if native is False:
        return None
    from posttrain.optim.native import last_error, load  # noqa: PLC0415 - builds a library on first use

    library = load("adamw8bit")
    if library is None:
        if native:
            raise RuntimeError(f"AdamW8bit(native=True): the C kernel is not available: {last_error['adamw8bit']}")
        warnings.warn(f"AdamW8bit: {last_error['adamw8bit']}; the torch update runs instead (the same "
                      f"arithmetic, about 3x slower a step)", stacklevel=3)
        return None
    kernel = library.adamw8bit_update
    kernel.restype = None
    kernel.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 6 + [ctypes.c_int]
    return kernel


def _plain_cpu_float32(t: torch.Tensor) -> bool:
    """A float32 tensor in this process's memory (not a DTensor shard, not on a GPU): what the C kernel reads."""
    return type(t.data) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu"


def _check_sizes(p: torch.Tensor, state: dict) -> None:
    """The C kernel trusts the codes' sizes with raw pointers: a wrong one (a damaged state) is an error here,
    not a write past the end."""
    expected = _code_shapes(p)
    got = [(tuple(state[k].shape), state[k].dtype) for k in CODE_KEYS]
    if not p.is_contiguous() or got != expected or not all(state[k].is_contiguous() for k in CODE_KEYS):
        raise ValueError(f"AdamW8bit: a parameter of shape {tuple(p.shape)} needs contiguous codes shaped {expected}; "
                         f"got {got}")


def _update_native(kernel, p, grad, state, beta1, beta2, eps, step_size, bias2_sqrt) -> None:
    """`_update_blocks`'s step by the C kernel: the whole parameter in one call, one pass a block (sizes
    checked by `_check_sizes`)."""
    grad = grad.contiguous()
    qm, sm, qv, sv = (state[k] for k in CODE_KEYS)
    kernel(p.data_ptr(), grad.data_ptr(), qm.data_ptr(), sm.data_ptr(), qv.data_ptr(), sv.data_ptr(), p.numel(),
           qm.shape[0], 1 - beta1, beta2, 1 - beta2, eps, step_size, bias2_sqrt, torch.get_num_threads())


def _update_blocks(p, grad, state, beta1, beta2, eps, step_size, bias2_sqrt) -> None:
    """The AdamW step over ``p``'s blocks, ``CHUNK_BLOCKS`` at a time: read the moments back, update
    them and the weights in float32, store them again (about 20 passes over a chunk in cache)."""
    n = p.numel()
    flat_p, flat_g = p.view(-1), grad.reshape(-1)
    qm, sm, qv, sv = (state[k] for k in ("exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale"))
    for b0 in range(0, qm.shape[0], CHUNK_BLOCKS):
        b1 = min(b0 + CHUNK_BLOCKS, qm.shape[0])
        lo, hi = b0 * BLOCK, min(b1 * BLOCK, n)
        g = _blocks(flat_g[lo:hi], b1 - b0)
        m = qm[b0:b1].float()
        m.mul_(m.abs()).mul_((sm[b0:b1] * (1 / 127.0 ** 2)).unsqueeze(1)).lerp_(g, 1 - beta1)
        r = torch.add(qv[b0:b1], 1.0).mul_((sv[b0:b1] * (1 / 256.0)).unsqueeze(1))  # v ** (1/4), read back
        v = r.square_().square_().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        _store_r(v.sqrt().sqrt_(), qv[b0:b1], sv[b0:b1])
        _store_m(m, qm[b0:b1], sm[b0:b1])
        update = m.div_(v.sqrt_().div_(bias2_sqrt).add_(eps)).view(-1)[: hi - lo]
        flat_p[lo:hi].add_(update, alpha=-step_size)


def _blocks(values: torch.Tensor, blocks: int) -> torch.Tensor:
    """``values`` as ``[blocks, BLOCK]`` float32, the last block padded with zeros."""
    short = blocks * BLOCK - values.numel()
    if short:
        return torch.nn.functional.pad(values.float(), (0, short)).view(blocks, BLOCK)
    return values.float().view(blocks, BLOCK)


def _inverse(top: torch.Tensor, levels: float) -> torch.Tensor:
    """``levels / top`` per block as a column (0 for an all-zero block, whose codes are then 0)."""
    return torch.where(top > 0, levels / top, torch.zeros_like(top)).unsqueeze(1)


def _store_m(m: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """``q = round(127 * sign(m) * sqrt(|m| / max|m|))``; ``m`` itself is left as it is."""
    code = m.abs()
    top = code.amax(dim=1)
    scale.copy_(top)
    code.mul_(_inverse(top, 1.0)).sqrt_().mul_(127.0).round_()
    q.copy_(code.copysign_(m))


def _store_r(r: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """``q = round(256 * r / max r) - 1`` in 0..255 (read back as ``max r * (q + 1) / 256``); overwrites ``r``."""
    top = r.amax(dim=1)
    scale.copy_(top)
    q.copy_(r.mul_(_inverse(top, 256.0)).round_().sub_(1.0).clamp_(0.0, 255.0))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors hold (moments, scales, step counters)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t))
