"""The demo: the default real pair behind three processes, a streamed code
completion, a two-turn chat, and the speed against the target alone."""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time

CODE_PROMPT = "Write a Python function `is_prime(n)` that returns True when n is a prime number."
WARM_UP_TOKENS = 32
CHAT = ["Give me a one-line Python expression that reverses a string s.", "Now do the same for a list."]


def target_alone(model: str, dtype: str, linear: str, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """Hugging Face generate(do_sample=False) on the target, in this process, one
    thread, timed after an untimed 4-token warm-up; linear="auto" gives the
    kernels a target service would use for this dtype."""
    import torch

    from tandem.default_models import resolve_model
    from tandem.modeling import ModelConfig, load_causal_lm

    torch.set_num_threads(1)
    model = load_causal_lm(resolve_model(model), ModelConfig(model, dtype=dtype, linear=linear))
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
        elapsed = time.perf_counter() - start
    return out[0, len(prompt_ids):].tolist(), new_tokens / elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="default-target", help="target model (default: %(default)s)")
    parser.add_argument("--draft", default="default-draft", help="draft model (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="dtype of both models; auto = what a service picks (tandem.cpu_kernels.auto_dtype: "
                             "bfloat16 on packed layers on a CPU with AMX, else float32 on bf16-held or fp16-weight "
                             "layers) (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per generation (default: %(default)s)")
    parser.add_argument("--pipeline", choices=["on", "off"], default="on", help="pipelined drafting")
    parser.add_argument("--draft-args", default="--quantize auto --vocab-subset 32768",
                        help="extra flags for `tandem serve draft` (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from tandem.client import TandemClient, collect
    from tandem.launch import Deployment, Service
    from tandem.redis_local import ensure_redis

    redis_url = ensure_redis()
    print(f"Redis at {redis_url}. Starting target, draft and orchestrator (one thread each)…", flush=True)
    target = Service("target", ["--model", args.target, "--dtype", args.dtype], threads=1, cpus="0")
    draft = Service("draft", ["--model", args.draft, "--dtype", args.dtype, *args.draft_args.split()],
                    threads=1, cpus="1")
    # --prefix-cache 0: each request prefills its prompt, as the target alone does.
    with Deployment(target, draft, ["--redis-url", redis_url, "--pipeline", args.pipeline,
                                    "--prefix-cache", "0"]) as deployment:
        with TandemClient(deployment.address) as client:
            info = client.server_info()
            print(f"target {info.target_model} · draft {info.draft_model} ({info.draft_backend}) · "
                  f"k {info.k} (adaptive {info.adaptive_k}, {info.k_min}..{info.k_max}) · pipeline {info.pipeline}\n")

            # An untimed warm-up, as the target alone gets: first-call costs (each
            # shape's kernels) stay out of the timing, and the orchestrator starts
            # from the step costs it has learned (shared by all sessions), as a
            # server that has run for a while does. It tries each block length
            # once before it knows its verify cost, and on a CPU whose verify
            # grows with the block those first tries cost a short request dearly.
            client.generate(CODE_PROMPT, max_tokens=WARM_UP_TOKENS)
            print(f"## Completion (after an untimed {WARM_UP_TOKENS}-token warm-up request)\n> {CODE_PROMPT}\n")
            start = time.perf_counter()
            result = collect(client.generate_stream(CODE_PROMPT, max_tokens=args.max_tokens),
                             on_delta=lambda d: print(d.text, end="", flush=True))
            tandem_s = time.perf_counter() - start
            tandem_tok_s = result.completion_tokens / tandem_s
            s = result.stats
            print(f"\n\n[{result.completion_tokens} tokens in {tandem_s:.1f}s: {tandem_tok_s:.2f} tok/s · "
                  f"acceptance {result.acceptance_rate:.2f} · {s.rounds} rounds · mean k {s.mean_k:.1f} (last: {s.k} fresh, {s.k_ahead} ahead) · "
                  f"pre-draft used {s.predraft_hits}/{s.predraft_attempts}]\n")

            print("## Two-turn chat")
            session = client.create_session()
            for turn, message in enumerate(CHAT, 1):
                print(f"\nuser> {message}\nassistant> ", end="", flush=True)
                reply = collect(client.chat_stream(session, message, max_tokens=48),
                                on_delta=lambda d: print(d.text, end="", flush=True))
                st = reply.stats
                print(f"\n[turn {turn}: prefilled {st.target_prefill_tokens} target / {st.draft_prefill_tokens} "
                      f"draft tokens for a {reply.prompt_tokens}-token turn · first token after "
                      f"{st.first_token_ms / 1e3:.2f}s · acceptance {reply.acceptance_rate:.2f}]")
            client.delete_session(session)

    print("\n## The target alone (Hugging Face generate, greedy, same prompt and length, one thread, after a warm-up)")
    from transformers import AutoTokenizer

    from tandem.default_models import resolve_model

    prompt_ids = AutoTokenizer.from_pretrained(resolve_model(args.target)).encode(CODE_PROMPT)
    from tandem.modeling import ModelConfig

    from tandem.cpu_kernels import baseline_configs, config_label, resolve_linear

    dtype = ModelConfig(args.target, dtype=args.dtype).resolved_dtype
    reference, target_tok_s = target_alone(args.target, dtype, "auto", prompt_ids, result.completion_tokens)
    same = reference == result.token_ids
    print(f"target alone ({dtype}, the target service's kernels) {target_tok_s:.2f} tok/s · "
          f"identical tokens: {same}")
    best_tok_s = target_tok_s
    for other_dtype, linear in baseline_configs("cpu", dtype)[1:]:  # others that may decode faster here
        _, other_tok_s = target_alone(args.target, other_dtype, linear, prompt_ids, result.completion_tokens)
        kernels = {"native": "nn.Linear", "fp16": "fp16-weight layers", "packed": "packed layers",
                   "bf16w": "bf16-weight layers", "bf16dot": "bf16 dot-product layers"}[
            resolve_linear(linear, "cpu", other_dtype)]
        print(f"target alone ({config_label(other_dtype, linear)}, {kernels}) {other_tok_s:.2f} tok/s")
        best_tok_s = max(best_tok_s, other_tok_s)
    print(f"Tandem {tandem_tok_s:.2f} tok/s · speedup {math.floor(tandem_tok_s / best_tok_s * 100) / 100:.2f}x "
          "over the fastest target alone (cut, not rounded)")
    if not same:
        first = next((i for i, (a, b) in enumerate(zip(reference, result.token_ids)) if a != b), None)
        print(f"(first difference at token {first}: multi-token verification sums in another order than "
              f"one-token decoding, and a near-tie went the other way; in {dtype}.)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
