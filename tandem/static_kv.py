"""StaticKV: a session's keys and values in preallocated buffers, written in
place by the lean forward (tandem/lean.py); rollback is a length change."""
from __future__ import annotations

import torch


class StaticKV:
    """A session's keys and values, [layers, kv_heads, capacity, head_dim] each;
    the first `length` positions are valid. Grows by doubling. The positions
    past the length hold zeros or stale keys, never garbage: the graphed step
    attends over the whole capacity behind a mask, and a NaN in a masked
    position still poisons the softmax (0 * NaN)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 min_capacity: int = 256):
        self.keys = torch.empty((layers, kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0
        self.min_capacity = min_capacity

    def reserve(self, length: int) -> None:
        layers, heads, capacity, head_dim = self.keys.shape
        if length <= capacity:
            return
        capacity = max(self.min_capacity, 1 << (length - 1).bit_length())
        for name in ("keys", "values"):
            held = getattr(self, name)
            grown = held.new_zeros((layers, heads, capacity, head_dim))
            grown[:, :, : self.length] = held[:, :, : self.length]
            setattr(self, name, grown)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """As DynamicCache.crop in transformers 5.24: crop(-n) drops the last n tokens."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def drop_partial_step(self, length: int) -> None:
        """After a forward stopped between layers: its writes lie past `length`
        and are never read."""
        self.length = min(self.length, length)

    def fork(self, length: int) -> "StaticKV":
        """A copy of the first `length` positions in buffers of its own (the
        whole capacity, so the positions past the length stay no garbage)."""
        import copy

        forked = copy.copy(self)
        forked.keys, forked.values = self.keys.clone(), self.values.clone()
        forked.length = min(length, self.length)
        return forked

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes
