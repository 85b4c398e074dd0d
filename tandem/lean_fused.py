"""The lean forward's layer stack as one C call (tandem/i4w.c), for an int4
draft on a CPU: what LeanRunner runs in place of its per-op layers where
every projection is on the i4w kernel."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem import i4w
from tandem.static_kv import StaticKV

if TYPE_CHECKING:
    from tandem.lean import LeanRunner


FUSED_ROWS = 16  # longer feeds (a prompt) take the per-op path, whose int4 layers then run their int8 copies


class FusedLayers:
    """The layer stack as one call of tandem/i4w.c (tandem_i4w_layers), for a
    float32 model whose every projection is an Int4Linear on the i4w kernel
    (the int4 draft on a CPU with AVX512-VNNI or AVX2 and no AMX). The per-op path and
    this compute the same function up to float32 rounding (another softmax and
    exp); each keeps every row independent of the others in its forward."""

    def __init__(self, table: torch.Tensor, keep: list[torch.Tensor], shape: dict, eps: tuple[float, float]):
        self.table, self._keep, self.shape, self.eps = table, keep, shape, eps

    @classmethod
    def build(cls, layers, runner: "LeanRunner") -> "FusedLayers | None":
        from draft_service.cheap import Int4Linear

        if runner.device.type != "cpu" or runner.dtype != torch.float32 or i4w.library() is None:
            return None
        if runner.head_dim % 2 or runner.head_dim > 512:
            return None
        rows, keep, eps = [], [], set()
        shape = dict(hidden=runner.embedding.shape[1], heads=runner.heads, kv_heads=runner.kv_heads,
                     head_dim=runner.head_dim, intermediate=None)
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            modules = [getattr(attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            modules += [getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
            if not all(isinstance(m, Int4Linear) and m.kernel == "i4w" and m.padded_out == m.out_features
                       for m in modules):
                return None
            shape["intermediate"] = modules[4].out_features
            norms = [n.weight.detach().float().contiguous() for n in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm)]
            eps.add((float(layer.input_layernorm.variance_epsilon),
                     float(layer.post_attention_layernorm.variance_epsilon)))
            keep += norms
            rows.append([m.packed.data_ptr() for m in modules]
                        + [0 if m.bias is None else m.bias.data_ptr() for m in modules]
                        + [t.data_ptr() for t in norms])
        sizes = (shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"],
                 shape["intermediate"])
        if len(eps) != 1 or any(n % 16 for n in sizes):
            return None
        table = torch.tensor(rows, dtype=torch.int64)
        assert table.shape[1] == len(i4w.LAYER_SLOTS), table.shape
        return cls(table, keep, shape, eps.pop())

    def __call__(self, x: torch.Tensor, kv: "StaticKV", start: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        i4w.layers(self.table, x, self.shape, self.eps, kv.keys, kv.values, start, cos.contiguous(),
                   sin.contiguous())
