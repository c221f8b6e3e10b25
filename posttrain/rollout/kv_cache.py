"""A KV cache that decodes without copying itself: room for the whole response is reserved once.

``transformers``' ``DynamicCache`` appends each decoded token by ``torch.cat``, which copies every
layer's keys and values at every step, a noticeable share of a decoding step of SmolLM2-135M on CPU
(`benchmarks/bench_decode.py`'s work; the figure in benchmarks/README.md, "KV cache"). After
prefill, :func:`reserve` moves each layer into buffers with room for ``new_tokens`` more positions;
a step then writes its one position in place and attention reads a view of the filled part (the
same values, so decoding is unchanged).

Only plain ``DynamicLayer`` layers are converted (sliding-window, quantized or other layer types
keep their own update rule); with a ``transformers`` that has no per-layer caches nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["reserve"]

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers without per-layer caches: decoding concatenates as before
    DynamicLayer = None


def reserve(cache: Any, new_tokens: int) -> bool:
    """Give every layer of ``cache`` room for ``new_tokens`` more positions; False (cache unchanged)
    when the cache or one of its layers is of a kind this does not handle."""
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized
                                                 for layer in layers):
        return False
    for i, layer in enumerate(layers):
        layers[i] = ReservedLayer(layer.keys, layer.values, layer.keys.shape[-2] + new_tokens)
    return True


if DynamicLayer is not None:

    class ReservedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose ``keys``/``values`` ``[B, H, L, d]`` are views of buffers
        ``[B, H, capacity, d]``: ``update`` writes the new positions in place (growing the buffers
        only past ``capacity``), ``batch_select_indices`` keeps rows by indexing the buffers."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
            super().__init__()
            self.device = keys.device
            self.length = keys.shape[-2]
            self._keys = _buffer_with(keys, capacity)
            self._values = _buffer_with(values, capacity)
            self.is_initialized = True
            self._publish()

        def _publish(self) -> None:
            self.keys = self._keys[:, :, :self.length]
            self.values = self._values[:, :, :self.length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            end = self.length + key_states.shape[-2]
            if end > self._keys.shape[-2]:  # more positions than reserved: double the room
                self._keys = _buffer_with(self.keys, 2 * end)
                self._values = _buffer_with(self.values, 2 * end)
            self._keys[:, :, self.length:end] = key_states
            self._values[:, :, self.length:end] = value_states
            self.length = end
            self._publish()
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._publish()

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
            self._publish()

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove < 0:  # transformers' convention: a negative count of positions to drop
                self.length = max(self.length + tokens_to_remove, 0)
                self._publish()
            else:
                super().crop(tokens_to_remove)

        def reset(self) -> None:
            self.length = 0
            self._publish()


def _buffer_with(states: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[B, H, capacity, d]`` holding ``states`` ``[B, H, L, d]`` in its first ``L`` positions."""
    batch, heads, length, dim = states.shape
    buffer = states.new_empty(batch, heads, capacity, dim)
    buffer[:, :, :length] = states
    return buffer
