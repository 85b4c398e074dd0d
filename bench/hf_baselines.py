"""The in-process Hugging Face baselines the benchmarks time Tandem against:
the target alone (HF generate, or the lean forward replayed from CUDA graphs on
a GPU) and HF assisted generation, each greedy, after an untimed warm-up."""
from __future__ import annotations

import logging
import time

import torch

from bench.common import ModeResult

log = logging.getLogger(__name__)


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """'auto' → what a model service on `device` picks (tandem.cpu_kernels.auto_dtype)."""
    from tandem.cpu_kernels import auto_dtype

    return auto_dtype(device) if dtype == "auto" else dtype


def load_hf(path: str, dtype: str, linear: str = "auto", device: str = "cpu"):
    """The bare HF model; linear="auto" gives the kernels a model service would
    use for `dtype` (on a CPU: fp16-weight or packed linear layers, see
    tandem.cpu_kernels), "native" plain nn.Linear."""
    from tandem.modeling import ModelConfig, load_causal_lm

    return load_causal_lm(path, ModelConfig(path, device=device, dtype=dtype, linear=linear))


def baselines(dtype: str, extra: str = "", device: str = "cpu", linear: str = "auto") -> list[tuple[str, str]]:
    """The (dtype, linear) configurations to time the target alone in: Tandem's
    own first (the identity reference; `linear` is the target service's
    --linear), every other that may decode faster on this machine, then `extra`
    ('bfloat16,float32/native'), each set of kernels once
    (tandem.cpu_kernels.baseline_configs)."""
    from tandem.cpu_kernels import baseline_configs, parse_config

    return baseline_configs(device, dtype, linear, [parse_config(label) for label in extra.split(",") if label])


def hf_assisted_config(k: int) -> dict:
    """How HF assisted generation runs in the benchmarks, set on the assistant's
    generation config rather than left to transformers' defaults, which move
    between versions: k tokens a block, and a block ends early after a token the
    assistant gives less than 0.4 (transformers' default in 5.x, applied where
    the model's own config leaves it unset; transformers retunes it between
    blocks when scikit-learn is installed, which Tandem does not install)."""
    return dict(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.4)


def hf_generate(model, prompts: dict[str, list[int]], new_tokens: int, assistant=None, k: int = 4) -> ModeResult:
    """Greedy HF generate over the prompts (assisted when `assistant` is given,
    as hf_assisted_config(k) says), after an untimed warm-up on each prompt, as
    the Tandem modes get."""
    result = ModeResult()
    hf_warm_up(model, prompts, assistant, k)
    for name, ids in prompts.items():
        hf_time(result, model, name, ids, new_tokens, assistant)
    return finish(result)


def hf_warm_up(model, prompts: dict[str, list[int]], assistant=None, k: int = 4) -> None:
    """Sets the assistant's generation config (hf_assisted_config(k)) and runs
    every prompt once, untimed: kernels set up per shape, as Tandem's warm-up."""
    if assistant is not None:
        for name, value in hf_assisted_config(k).items():
            setattr(assistant.generation_config, name, value)
    for ids in prompts.values():
        _hf_run(model, ids, 4, assistant)


def hf_time(result: ModeResult, model, name: str, ids: list[int], new_tokens: int, assistant=None) -> None:
    """One prompt through HF generate, timed and added to `result`."""
    start = time.perf_counter()
    out = _hf_run(model, ids, new_tokens, assistant)
    elapsed = time.perf_counter() - start
    tokens = out[0, len(ids):].tolist()
    result.outputs[name] = tokens
    result.tokens += len(tokens)
    result.seconds += elapsed
    log.info("%s: %d tokens in %.1fs", name, len(tokens), elapsed)


def _hf_run(model, ids: list[int], max_new_tokens: int, assistant=None):
    x = torch.tensor([ids], device=model.device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(x))
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    with torch.inference_mode():
        return model.generate(x, **kwargs)


def lean_generate(model, prompts: dict[str, list[int]], new_tokens: int, device: str) -> ModeResult:
    """Greedy decoding of `model` alone, one token a forward, each one-token
    forward replayed from a CUDA graph of the lean forward (tandem.lean, as the
    target service's --graphs verifies): the target alone on the kernels and
    launches Tandem's graphed verify has, for a fair baseline on a GPU. Stops
    at an end-of-sequence token, as generate does; untimed warm-up first."""
    from tandem.lean import LeanRunner
    from tandem.modeling import LoadedModel, eos_token_ids

    loaded = LoadedModel(model=model, tokenizer=None, model_id="", tokenizer_fingerprint="",
                         vocab_size=int(model.get_output_embeddings().out_features), max_context=1 << 20,
                         eos_token_ids=eos_token_ids(model))
    runner = LeanRunner(loaded, device, fused=False, graphs=torch.device(device).type == "cuda", static_rows=1)
    eos = set(loaded.eos_token_ids)

    def decode(ids: list[int], count: int) -> list[int]:
        kv = runner.new_cache()
        token = int(runner.forward(kv, ids, 1)[0].argmax())
        out = [token]
        while len(out) < count and token not in eos:
            token = int(runner.forward(kv, [token], 1)[0].argmax())
            out.append(token)
        return out

    for ids in prompts.values():
        decode(ids, 4)
    result = ModeResult()
    for name, ids in prompts.items():
        start = time.perf_counter()
        tokens = decode(ids, new_tokens)
        result.seconds += time.perf_counter() - start
        result.outputs[name] = tokens
        result.tokens += len(tokens)
    return finish(result)


def finish(result: ModeResult) -> ModeResult:
    """Tokens/s over the prompts added to an HF mode."""
    result.prompts = len(result.outputs)
    result.tok_s = result.tokens / result.seconds if result.seconds else 0.0
    return result
