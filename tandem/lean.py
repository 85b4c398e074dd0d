"""A lean forward pass on a preallocated KV cache: the draft's steps, and on a
GPU the target's verifies.

A draft step feeds one token through a small model, and on a CPU a good part of
its time is not in the matrix products: Hugging Face's general forward runs
module calls, hooks, mask and rotary set-up, and a DynamicCache that copies
every layer's keys and values (torch.cat) on every step. For the Llama family
(Qwen2, Llama, Mistral: RMSNorm, rotary embeddings, grouped-query attention, a
gated SiLU MLP) LeanRunner computes the same function with the model's own
layers and weights in a plain loop, and writes keys and values in place
(StaticKV), as gpt-fast does: rollback is a length change.

For the draft it changes nothing but its speed: its numbers may differ from
Hugging Face's forward in the last bits (another attention path), and the
target verifies every drafted token, so the output stays the target's. The
target's verify on it computes the target's function up to those bits, as a
verify of k+1 tokens already does against one-token decoding: in float32 the
greedy output equals Hugging Face's generate (tests/test_lean.py, and the
end-to-end suites on a GPU).
Measured on a 2-core Zen 5 VM (int8 draft with a 32k head, 200-token cache,
the same 31 greedy tokens as the HF forward): a step took 17.1 ms against
20.5 ms on one thread, and 12.0 ms against 15.2 ms on two (bench/RESULTS.md).

With an int4 draft on tandem/i4w.c, a feed of up to 16 tokens runs its whole
layer stack in one C call (FusedLayers, tandem_i4w_layers): one step of the
default draft took 9.67 ms against 16.00 ms per op (Zen 4 VM, one thread).

On a GPU a step is bound by the host: a few ms of kernels behind hundreds of
launches. There a feed of up to `static_rows` tokens replays a CUDA graph
(tandem/graphs.py) of a forward whose shapes never change: the position is a tensor, the
keys and values go in with index_copy_, and the attention covers the whole
capacity behind a mask. The graphs read and write the runner's own buffers, one
pair per capacity, so they are captured once per process, not once per
session: a session's cache moves into its capacity's buffers when it runs there
(a copy of its keys and values, microseconds on a GPU), and the session that
held them before gets a copy of its own. The draft service replays its steps
and the feeds of up to 16 tokens before them; the target service (--graphs)
its verify blocks of up to 16 tokens.
Measured on an H100 (the default draft's shapes, bf16, bench.step_probe): a
draft step took 3.6 ms replayed, 11.8-13.4 ms eagerly here and 17.8-22.0 ms
through Hugging Face's forward.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from tandem.graphs import MAX_STATIC_ROWS, Bank
from tandem.lean_fused import FUSED_ROWS, FusedLayers
from tandem.static_kv import StaticKV

log = logging.getLogger(__name__)

MODEL_TYPES = ("qwen2", "llama", "mistral")
ROPE_TYPES = ("default", "linear", "llama3")  # inv_freq fixed at load, whatever the length
LEAN_STEP = ("auto", "on", "aten", "off")  # aten: lean, without the fused i4w layers


def unsupported(model: torch.nn.Module) -> str | None:
    """Why LeanRunner cannot run `model`, or None when it can."""
    config = model.config
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r} (supported: {', '.join(MODEL_TYPES)})"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    window = getattr(config, "sliding_window", None)  # Mistral: a window for every layer, no layer_types
    if window and getattr(config, "layer_types", None) is None and window < getattr(config, "max_position_embeddings", 0):
        return f"sliding-window attention (window {window})"
    base = model.base_model
    if not getattr(base, "layers", None):
        return "no decoder layers"
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding with a fixed inv_freq"
    if getattr(rotary, "rope_type", "default") not in ROPE_TYPES:
        return f"rope type {rotary.rope_type!r}"
    for layer in base.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attention is None or not all(hasattr(attention, n) for n in names):
            return "attention without q/k/v/o projections"
        if hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):
            return "query/key norms"
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP without gate/up/down projections"
    return None


def _projection(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's forward without nn.Module's call machinery; an int8 dynamic
    layer calls its fbgemm op directly, as its forward does."""
    packed = getattr(getattr(module, "_packed_params", None), "_packed_params", None)
    if packed is not None and module._packed_params.dtype == torch.qint8 and getattr(module, "version", 0) >= 4:
        op = torch.ops.quantized.linear_dynamic
        return lambda x: op(x, packed, True)
    return module.forward


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm of the Llama family: float32 inside."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, T, head_dim]; cos, sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Layer:
    def __init__(self, layer: torch.nn.Module):
        attention, mlp = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = (_projection(getattr(attention, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        self.gate, self.up, self.down = (_projection(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon


# A graphed runner's caches start here: a cache that grows moves on to a capacity
# whose graphs may not be captured yet.
GRAPH_MIN_CAPACITY = 1024


class LeanRunner:
    """ModelRunner's interface (new_cache, forward, forward_block, last_hidden)
    over StaticKV caches, for the models `unsupported` accepts. `before_layer`,
    when set, runs before each layer (the drafter's cancellation check).

    `static_rows`: feeds of up to that many tokens run the static forward on the
    runner's buffers (tandem.graphs.Bank); `graphs`: they replay a CUDA graph of it (on a CUDA
    device only). Without graphs the static forward runs as it is: tests check
    it and the buffers' hand-over on the CPU. The default is 1 with graphs
    (one-token steps), else 0 (the per-op path for every feed)."""

    def __init__(self, loaded, device: str, fused: bool = True, graphs: bool = False, static_rows: int | None = None):
        self.loaded = loaded
        self.model = model = loaded.model
        self.device = torch.device(device)
        base, config = model.base_model, model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.embedding = base.embed_tokens.weight
        self.dtype = self.embedding.dtype  # of the activations and the cache
        self.layers = [_Layer(layer) for layer in base.layers]
        self.norm = base.norm
        self.head = model.get_output_embeddings()
        self.inv_freq = base.rotary_emb.inv_freq.detach().float()
        self.rotary_scale = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        self.before_layer: Callable[[], None] | None = None
        self.fused = FusedLayers.build(base.layers, self) if fused else None
        if self.fused is not None:
            log.info("draft steps of up to %d tokens run their layers in tandem/i4w.c", FUSED_ROWS)
        if graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.graphs = graphs
        self.static_rows = (1 if graphs else 0) if static_rows is None else static_rows
        if not 0 <= self.static_rows <= MAX_STATIC_ROWS:
            raise ValueError(f"static_rows must lie in [0, {MAX_STATIC_ROWS}], got {self.static_rows}")
        self.banks: dict[int, Bank] = {}  # by capacity
        if graphs:
            log.info("feeds of up to %d tokens replay a CUDA graph", self.static_rows)

    def new_cache(self) -> StaticKV:
        return StaticKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device,
                        GRAPH_MIN_CAPACITY if self.graphs else 256)

    def _rotary_table(self, length: int) -> None:
        if length <= self.cos.shape[0]:
            return
        length = max(1024, 1 << (length - 1).bit_length())
        positions = torch.arange(length, dtype=torch.float32, device=self.inv_freq.device)
        angles = torch.outer(positions, self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [length, head_dim]
        self.cos = (angles.cos() * self.rotary_scale).to(self.dtype)
        self.sin = (angles.sin() * self.rotary_scale).to(self.dtype)

    def _hidden(self, kv: StaticKV, tokens: list[int]) -> torch.Tensor:
        """Runs tokens through the layers after kv's tokens; [T, hidden] before the final norm."""
        count, start = len(tokens), kv.length
        end = start + count
        kv.reserve(end)
        if count <= self.static_rows:
            return self._static(kv, tokens)
        self._rotary_table(end)
        cos, sin = self.cos[start:end], self.sin[start:end]
        if self.fused is not None and count <= FUSED_ROWS:
            if self.before_layer is not None:
                self.before_layer()  # the only check: the layers run in one C call
            x = self.embedding[torch.tensor(tokens, device=self.device)]  # [T, hidden], a copy
            self.fused(x, kv, start, cos, sin)
            kv.length = end
            return x
        mask = None if count == 1 else torch.ones(count, end, dtype=torch.bool, device=self.device).tril(start)
        x = self.embedding[torch.tensor(tokens, device=self.device)]  # [T, hidden]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            if self.before_layer is not None:
                self.before_layer()
            h = _rms_norm(x, layer.norm1, layer.eps1)
            q = _rotate(layer.q(h).view(count, heads, head_dim).transpose(0, 1), cos, sin)
            k = _rotate(layer.k(h).view(count, kv_heads, head_dim).transpose(0, 1), cos, sin)
            kv.keys[i, :, start:end] = k
            kv.values[i, :, start:end] = layer.v(h).view(count, kv_heads, head_dim).transpose(0, 1)
            attended = F.scaled_dot_product_attention(q[None], kv.keys[i, None, :, :end], kv.values[i, None, :, :end],
                                                      attn_mask=mask, enable_gqa=kv_heads != heads)  # [1, heads, T, hd]
            x = x + layer.o(attended[0].transpose(0, 1).reshape(count, heads * head_dim))
            h = _rms_norm(x, layer.norm2, layer.eps2)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        kv.length = end
        return x

    def _static(self, kv: StaticKV, tokens: list[int]) -> torch.Tensor:
        capacity = kv.keys.shape[2]
        bank = self.banks.get(capacity)
        if bank is None:
            bank = self.banks[capacity] = Bank(self, kv)
        bank.admit(kv)
        if self.before_layer is not None:
            self.before_layer()  # the only check: the layers run in one replay
        x = bank.step(len(tokens))(tokens, kv.length)
        kv.length += len(tokens)
        return x

    def static_block(self, keys: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor, position: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """T tokens through the layers with shapes that do not depend on the
        position: tokens is a [T] and position a [1] int64 tensor on the device
        (the first token's position), keys and values a bank's whole buffers
        ([layers, kv_heads, capacity, head_dim]), cos and sin the rotary table
        over the capacity. Writes the tokens' keys and values at their positions,
        and each token attends to every position up to its own. Returns their
        [T, hidden] states before the final norm. tandem.graphs.Step captures it; it runs as
        it is anywhere (tests run it on the CPU)."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        count, capacity = tokens.shape[0], keys.shape[2]
        positions = position + torch.arange(count, device=keys.device)  # [T]
        cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)  # [T, head_dim]
        mask = torch.arange(capacity, device=keys.device)[None] <= positions[:, None]  # [T, capacity]
        x = self.embedding.index_select(0, tokens)  # [T, hidden]
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.norm1, layer.eps1)
            q = _rotate(layer.q(h).view(count, heads, head_dim).transpose(0, 1), cos, sin)
            k = _rotate(layer.k(h).view(count, kv_heads, head_dim).transpose(0, 1), cos, sin)
            keys[i].index_copy_(1, positions, k)
            values[i].index_copy_(1, positions, layer.v(h).view(count, kv_heads, head_dim).transpose(0, 1))
            attended = F.scaled_dot_product_attention(q[None], keys[i, None], values[i, None], attn_mask=mask,
                                                      enable_gqa=kv_heads != heads)  # [1, heads, T, hd]
            x = x + layer.o(attended[0].transpose(0, 1).reshape(count, heads * head_dim))
            h = _rms_norm(x, layer.norm2, layer.eps2)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        return x

    @torch.inference_mode()
    def forward(self, kv: StaticKV, tokens: list[int], logits_to_keep: int) -> torch.Tensor:
        """As ModelRunner.forward: [logits_to_keep, vocab] float32 logits."""
        assert tokens and 1 <= logits_to_keep <= len(tokens), (len(tokens), logits_to_keep)
        hidden = self.norm(self._hidden(kv, tokens)[-logits_to_keep:])
        return self.head(hidden).float()

    def forward_block(self, kv: StaticKV, tokens: list[int], k: int) -> torch.Tensor:
        """As ModelRunner.forward_block (the target service's verify): [k + 1,
        vocab] float32 logits after the token before the block and after each of
        the block's k tokens."""
        return self.forward(kv, tokens, logits_to_keep=k + 1)

    @torch.inference_mode()
    def forward_batch(self, feeds: list[tuple[StaticKV, list[int], int]]) -> list[torch.Tensor]:
        """Several sessions' feeds in one pass over the layers: each feed is
        (kv, tokens, logits_to_keep), and its logits are what forward(kv, tokens,
        logits_to_keep) gives. The projections and the MLP run once over all the
        feeds' rows (the weights are read once, not once a session); attention
        runs per feed, on its own cache. Per-op path only (no static buffers,
        no fused layers)."""
        logits = self.head(self.hidden_batch(feeds)).float()
        return list(logits.split([keep for _, _, keep in feeds]))

    @torch.inference_mode()
    def hidden_batch(self, feeds: list[tuple[StaticKV, list[int], int]]) -> torch.Tensor:
        """As forward_batch, up to the head: the feeds' kept rows after the
        final norm, one feed after another ([sum of logits_to_keep, hidden])."""
        assert feeds and all(tokens and 1 <= keep <= len(tokens) for _, tokens, keep in feeds)
        counts = [len(tokens) for _, tokens, _ in feeds]
        starts = [kv.length for kv, _, _ in feeds]
        for (kv, _, _), start, count in zip(feeds, starts, counts):
            kv.reserve(start + count)
        self._rotary_table(max(s + c for s, c in zip(starts, counts)))
        cos = torch.cat([self.cos[s:s + c] for s, c in zip(starts, counts)])  # [rows, head_dim]
        sin = torch.cat([self.sin[s:s + c] for s, c in zip(starts, counts)])
        masks = [None if c == 1 else torch.ones(c, s + c, dtype=torch.bool, device=self.device).tril(s)
                 for s, c in zip(starts, counts)]
        rows = sum(counts)
        x = self.embedding[torch.tensor([t for _, tokens, _ in feeds for t in tokens], device=self.device)]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.norm1, layer.eps1)
            q_all = _rotate(layer.q(h).view(rows, heads, head_dim).transpose(0, 1), cos, sin)  # [heads, rows, hd]
            k_all = _rotate(layer.k(h).view(rows, kv_heads, head_dim).transpose(0, 1), cos, sin)
            v_all = layer.v(h).view(rows, kv_heads, head_dim).transpose(0, 1)
            attended, row = [], 0
            for (kv, _, _), start, count, mask in zip(feeds, starts, counts, masks):
                end = start + count
                kv.keys[i, :, start:end] = k_all[:, row:row + count]
                kv.values[i, :, start:end] = v_all[:, row:row + count]
                out = F.scaled_dot_product_attention(q_all[None, :, row:row + count], kv.keys[i, None, :, :end],
                                                     kv.values[i, None, :, :end], attn_mask=mask,
                                                     enable_gqa=kv_heads != heads)  # [1, heads, T, hd]
                attended.append(out[0].transpose(0, 1).reshape(count, heads * head_dim))
                row += count
            x = x + layer.o(torch.cat(attended))
            h = _rms_norm(x, layer.norm2, layer.eps2)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        kept, row = [], 0
        for (kv, _, keep), start, count in zip(feeds, starts, counts):
            kv.length = start + count
            row += count
            kept.append(x[row - keep:row])
        return self.norm(torch.cat(kept))

    verifies_trees = False  # no forward_tree: a verify takes the block alone
    attends_row_by_row = False

    @torch.inference_mode()
    def last_hidden(self, kv: StaticKV, tokens: list[int]) -> torch.Tensor:
        """As ModelRunner.last_hidden: the [hidden] state of the last token."""
        assert tokens
        return self.norm(self._hidden(kv, tokens)[-1:])[0]


def lean_runner(loaded, device: str, choice: str) -> LeanRunner | None:
    """LeanRunner for --lean-step on or aten, or auto, when the model allows it;
    None for off. aten: without the fused i4w layers on a CPU, without CUDA
    graphs on a GPU."""
    if choice not in LEAN_STEP:
        raise ValueError(f"lean_step must be one of {LEAN_STEP}, got {choice!r}")
    if choice == "off":
        return None
    reason = unsupported(loaded.model)
    if reason is None:
        log.info("draft steps run the lean forward (StaticKV)")
        graphs = torch.device(device).type == "cuda" and choice != "aten"
        # With graphs, every feed of up to MAX_STATIC_ROWS tokens replays one:
        # a step, and the tokens a verify accepted after a block the draft did
        # not run whole (its last token and the target's), which the per-op
        # path took 11.4 ms to run against 3.8 for a replayed step (H200).
        return LeanRunner(loaded, device, fused=choice != "aten", graphs=graphs,
                          static_rows=MAX_STATIC_ROWS if graphs else None)
    if choice in ("on", "aten"):
        raise ValueError(f"--lean-step on: the draft model is not supported: {reason}")
    log.info("draft steps run Hugging Face's forward: the lean forward does not support %s", reason)
    return None
