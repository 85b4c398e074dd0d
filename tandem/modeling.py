"""Loading a Hugging Face causal LM and running it on a KV cache.

Both model services use this module: it is the only place that touches
transformers' model classes.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tandem import cpu_kernels
from tandem.tokenizer import load_tokenizer, tokenizer_fingerprint

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROW_BY_ROW = "tandem_row_by_row"  # the attention of models on --linear bf16dot
ROW_BY_ROW_MAX = 16  # longer blocks (a prompt) attend as one


def row_by_row_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, one query row at a time over the keys up to its own position, for
    blocks of 2 to ROW_BY_ROW_MAX queries of one sequence; others as SDPA.

    Why: SDPA over a block of queries sums in another order than over one
    query, so a verify's rows differ from one-token decoding's in the last
    float32 bit. With float32 linear layers that has not changed a greedy
    token in any recorded run; with bf16dot, which rounds each layer's input
    to bf16, such a bit can move a rounding and the difference grows to a
    near-tie (3 of 4 bench prompts stayed identical). Row by row, a verify's
    logits equal decoding's bit for bit (tests/test_cpu_kernels.py), for
    about the cost of the block's attention again (small beside its layers)."""
    rows = query.shape[2]  # query: [batch, heads, rows, head_dim]
    if rows == 1 or rows > ROW_BY_ROW_MAX or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    keys = key.shape[2]
    outputs = []
    for row in range(rows):  # a row sees the keys up to its own, as a one-token decode of it would
        seen = keys - (rows - 1 - row)
        output, _ = sdpa_attention_forward(module, query[:, :, row:row + 1], key[:, :, :seen], value[:, :, :seen],
                                           None, **kwargs)
        outputs.append(output)  # [batch, 1, heads, head_dim]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(ROW_BY_ROW, row_by_row_attention)


INLINE_COMPUTE = ("auto", "on", "off")


CPU_PREFILL_CHUNK = 256  # ModelConfig.chunk's auto (tandem.cli_flags' --prefill-chunk help says them)
GPU_PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class ModelConfig:
    """Where a model service's model comes from and where it runs."""

    model: str  # local directory, hub id, or an alias of tandem.default_models
    device: str = "cpu"
    dtype: str = "auto"  # "auto": tandem.cpu_kernels.auto_dtype (bfloat16 on GPUs and on CPUs with AMX, else float32 on bf16w or fp16 weights)
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default on a CPU, 1 on a GPU (use_gpu_host_settings)
    linear: str = "auto"  # "native": nn.Linear; "packed": oneDNN float32, or bf16 with native bf16 (CPU); "fp16": FBGEMM on exact fp16 weights; "auto": the fastest that fits
    inline_compute: str = "auto"  # short calls on the server's event loop: "on", "off", "auto" (tandem.model_service.inline_compute)
    prefill_chunk: int | None = None  # new tokens a worker call in a long prefill, others' calls between; 0 = whole; None: auto

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.linear not in cpu_kernels.LINEAR_KERNELS:
            raise ValueError(f"linear must be one of {cpu_kernels.LINEAR_KERNELS}, got {self.linear!r}")
        if self.linear != "auto":  # raises on an impossible choice (auto has none, and may measure: kernel)
            cpu_kernels.resolve_linear(self.linear, self.device, self.resolved_dtype)
        if self.inline_compute not in INLINE_COMPUTE:
            raise ValueError(f"inline_compute must be one of {INLINE_COMPUTE}, got {self.inline_compute!r}")
        if self.prefill_chunk is not None and self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = off), got {self.prefill_chunk}")

    @property
    def chunk(self) -> int:
        """prefill_chunk, or auto's: 256 tokens on a CPU (where the default
        target prefilled 74-81 tokens a second in such chunks on one core of a
        Zen 5 VM, so a chunk holds other sessions' rounds up for 3.1-3.5 s),
        2048 on a GPU (README: "--prefill-chunk")."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return CPU_PREFILL_CHUNK if self.device == "cpu" else GPU_PREFILL_CHUNK

    @property
    def resolved_dtype(self) -> str:
        return cpu_kernels.auto_dtype(self.device) if self.dtype == "auto" else self.dtype

    @property
    def kernel(self) -> str:
        """"native", "packed", "fp16", "bf16w" or "bf16dot": what `linear`
        resolves to here, at this config's threads."""
        return cpu_kernels.resolve_linear(self.linear, self.device, self.resolved_dtype, self.threads)

    @property
    def packed(self) -> bool:
        return self.kernel != "native"


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object | None  # a transformers tokenizer, or None
    model_id: str
    tokenizer_fingerprint: str
    vocab_size: int  # rows of the output layer
    max_context: int
    eos_token_ids: tuple[int, ...]


def load_causal_lm(path: str, config: ModelConfig, pack: bool = True) -> torch.nn.Module:
    """The bare Hugging Face model, in eval mode on its device, with replaced
    linear layers where the config asks for them (and `pack` allows)."""
    log.info("loading %s (%s, %s, %s linear)", path, config.device, config.resolved_dtype,
             config.kernel if pack else "native")
    if config.device.startswith("cuda"):
        use_gpu_host_settings(config.threads)
    elif config.threads:
        torch.set_num_threads(config.threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[config.resolved_dtype])
    model.to(config.device).eval()
    if pack and config.packed:
        cpu_kernels.pack_linears(model, config.kernel)
        if config.kernel == "bf16dot":
            model.set_attn_implementation(ROW_BY_ROW)
    return model


def use_gpu_host_settings(threads: int = 0) -> None:
    """What a process that runs a model on a GPU sets on its host side. A decode
    step of these models is a few ms of GPU work behind many small kernel
    launches, so the CPU is the bottleneck: one intra-op thread (unless `threads`
    says otherwise), and no cuDNN attention, whose per-call planning runs on the
    CPU (2.7 ms of CPU per attention call, 16 threads, in a profile of the
    default target on an H100).
    Measured there: a one-token forward of the default target 101.8 ms with
    torch's default 16 threads, 27.5 ms with one; the target alone through
    generate() 50.1 ms a token before both settings, 25.4 ms after."""
    torch.set_num_threads(threads or 1)
    torch.backends.cuda.enable_cudnn_sdp(False)


def load(config: ModelConfig, pack: bool = True) -> LoadedModel:
    """The model with its identity. pack=False leaves nn.Linear layers for a
    caller that transforms them first (the draft's int8 and reduced head)."""
    from tandem.default_models import resolve_model

    path = resolve_model(config.model)
    model = load_causal_lm(path, config, pack)
    tokenizer = load_tokenizer(path)
    vocab_size = int(model.get_output_embeddings().out_features)  # nn.Linear or PackedLinear
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=config.model,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer, vocab_size),
        vocab_size=vocab_size,
        max_context=int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20),
        eos_token_ids=eos_token_ids(model),
    )


def load_identity(config: ModelConfig) -> LoadedModel:
    """The model's identity (tokenizer, vocabulary, context) without its weights,
    for drafters that need no model."""
    from transformers import AutoConfig, GenerationConfig

    from tandem.default_models import resolve_model

    path = resolve_model(config.model)
    model_config = AutoConfig.from_pretrained(path)
    tokenizer = load_tokenizer(path)
    vocab_size = int(model_config.vocab_size)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = model_config.eos_token_id
    eos = () if eos is None else tuple(eos if isinstance(eos, (list, tuple)) else [eos])
    return LoadedModel(
        model=None, tokenizer=tokenizer, model_id=config.model,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer, vocab_size), vocab_size=vocab_size,
        max_context=int(getattr(model_config, "max_position_embeddings", 0) or 1 << 20),
        eos_token_ids=tuple(int(e) for e in eos),
    )


def eos_token_ids(model) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of forward()'s KV-cache argument: `cache` from transformers 5.24
    on (`past_key_values` is deprecated there, to be removed in 5.40),
    `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class ModelRunner:
    """Runs new tokens through the model on a session's KV cache."""

    def __init__(self, loaded: LoadedModel, device: str):
        self.loaded = loaded
        self.model = loaded.model
        self.device = torch.device(device)
        self._cache_kwarg = cache_kwarg(self.model)
        self._base_cache_kwarg = cache_kwarg(self.model.base_model)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, cache: DynamicCache, tokens: list[int], logits_to_keep: int) -> torch.Tensor:
        """Appends tokens to the cache; returns [logits_to_keep, vocab] float32 logits
        for the last logits_to_keep positions."""
        assert tokens and 1 <= logits_to_keep <= len(tokens), (len(tokens), logits_to_keep)
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=logits_to_keep,
                         **{self._cache_kwarg: cache})
        return out.logits[0, -logits_to_keep:].float()

    @property
    def attends_row_by_row(self) -> bool:
        return self.model.config._attn_implementation == ROW_BY_ROW

    def forward_block(self, cache: DynamicCache, tokens: list[int], k: int) -> torch.Tensor:
        """Appends tokens, whose last k are a draft block, to the cache; returns
        [k + 1, vocab] float32 logits: after the token before the block, and
        after each of the block's.

        On a model that attends row by row, a block that comes after more than
        one new token (a prompt, a re-sync) runs in a forward of its own, after
        a forward of the tokens before it: the block's rows then give what
        one-token decoding gives, bit for bit, and the tokens before it what a
        prefill of them alone gives (the target alone's, for a prompt). In one
        forward the block's rows would be rows of a longer block, which
        attends as a whole (past ROW_BY_ROW_MAX rows)."""
        before = len(tokens) - k
        if k and before > 1 and self.attends_row_by_row:
            first = self.forward(cache, tokens[:before], logits_to_keep=1)  # [1, vocab]
            return torch.cat([first, self.forward(cache, tokens[before:], logits_to_keep=k)])
        return self.forward(cache, tokens, logits_to_keep=k + 1)

    @property
    def verifies_trees(self) -> bool:
        """Whether forward_tree may run: the model attends through a mask (a row-by-row
        model assumes each row sees every key before its own)."""
        return not self.attends_row_by_row

    @torch.inference_mode()
    def forward_tree(self, cache: DynamicCache, tokens: list[int], k: int,
                     alternatives: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Like forward_block, with alternative tokens beside the block: each
        (j, token) stands in for the block's token j, seeing what token j sees
        (the tokens before it) but not token j nor the block after it. Appends
        tokens and then the alternatives to the cache, in one forward.

        Returns ([k + 1, vocab] logits of the block as forward_block's, and
        [len(alternatives), vocab] logits after each alternative). The cache then
        holds the alternatives' keys and values after the block's; keep_path
        moves the one a verdict takes into place."""
        assert k >= 1 and len(tokens) >= k + 1 and alternatives, (len(tokens), k, alternatives)
        past = cache.get_seq_length()
        rows = len(tokens) + len(alternatives)
        mask = torch.ones(rows, past + rows, dtype=torch.bool, device=self.device).tril(past)
        positions = list(range(past, past + len(tokens)))
        first = past + len(tokens) - k  # absolute position of the block's token 0
        for i, (j, _) in enumerate(alternatives):
            assert 0 <= j < k, (j, k)
            row = len(tokens) + i
            mask[row, first + j:] = False  # not token j nor anything after it...
            mask[row, past + row] = True  # ...but itself
            positions.append(first + j)
        input_ids = torch.tensor([tokens + [t for _, t in alternatives]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, attention_mask=mask[None, None],
                         position_ids=torch.tensor([positions], device=self.device), use_cache=True,
                         logits_to_keep=k + 1 + len(alternatives), **{self._cache_kwarg: cache})
        logits = out.logits[0].float()
        return logits[: k + 1], logits[k + 1:]

    @staticmethod
    @torch.inference_mode()
    def keep_path(cache: DynamicCache, keep: int, moved_from: int | None = None) -> None:
        """Crops the cache to its first `keep` positions; with moved_from, the
        keys and values at that position (an alternative of forward_tree) first
        replace position keep - 1."""
        for layer in cache.layers:
            if moved_from is not None:
                layer.keys[:, :, keep - 1] = layer.keys[:, :, moved_from]
                layer.values[:, :, keep - 1] = layer.values[:, :, moved_from]
            extra = layer.get_seq_length() - keep
            if extra > 0:
                layer.crop(-extra)

    @torch.inference_mode()
    def last_hidden(self, cache: DynamicCache, tokens: list[int]) -> torch.Tensor:
        """Appends tokens to the cache; returns the [hidden] state of the last one,
        before the output layer (for drafters with their own head)."""
        assert tokens
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.model.base_model(input_ids=input_ids, use_cache=True, **{self._base_cache_kwarg: cache})
        return out.last_hidden_state[0, -1]
