"""Fixtures: tiny random models built from configs, and real Tandem clusters
(three gRPC servers on 127.0.0.1 sockets, real Redis) running in a background
event loop."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from tandem.model_service import CacheConfig
from tandem.modeling import ModelConfig

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
# The clusters' model services run here; TANDEM_TEST_DEVICE=cuda runs them on a
# GPU (the references stay on the CPU in float32).
DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
TINY_VOCAB = 128
# The files that take longest, roughly longest first (their tests' durations
# summed on a 2-core Zen 3 VM: 4.8 minutes down to 0.6). `make test` hands whole files to its two
# workers in collection order (--dist loadfile --no-loadscope-reorder), and these
# go first, so that neither worker is left with one of them at the end while the
# other idles. (By default xdist starts the files with the most tests first, and
# these have few.)
LONG_FILES = ("test_bench_nodes.py", "test_real_pair.py", "test_replicas.py", "test_ray.py", "test_subset_draws.py",
              "test_logit_bias.py", "test_errors.py", "test_tls.py", "test_http_api.py", "test_prefix_cache.py",
              "test_chunked_prefill.py", "test_batching.py", "test_launch.py", "test_structured.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: each file's own order kept


def build_tiny_model(path, seed: int, vocab: int = TINY_VOCAB, max_context: int = 512) -> str:
    """A 2-layer Qwen2 with random weights, saved without a tokenizer. The
    weights are bf16 values kept in float32, as in released checkpoints, so a
    float32 service runs them on its fp16-weight kernels (tandem.cpu_kernels)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
        initializer_range=0.2, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
    model.save_pretrained(path)
    return str(path)


def save_char_tokenizer(path) -> None:
    """One token per ASCII character (ids 0-127, the tiny models' vocabulary),
    with a chat template: enough for the benchmark's prompts."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({chr(i): i for i in range(TINY_VOCAB)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?", pad_token=chr(0))
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def char_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    dirs = {"target": build_tiny_model(root / "target", seed=0), "draft": build_tiny_model(root / "draft", seed=1)}
    for path in dirs.values():
        save_char_tokenizer(path)
    return dirs


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "target": build_tiny_model(root / "target", seed=0),
        "other": build_tiny_model(root / "other", seed=1),
        "wide": build_tiny_model(root / "wide", seed=2, vocab=256),
    }


@pytest.fixture(scope="session")
def near_draft(tiny_models, tmp_path_factory):
    """The target with noise on its weights: a draft that agrees with it often,
    and whose runner-up is often the target's token where it does not."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator) * param.std() * 0.5
            param.add_(noise).copy_(param.bfloat16().float())
    path = tmp_path_factory.mktemp("near")
    model.save_pretrained(path)
    return str(path)


def reference_greedy(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face generate(do_sample=False) on the target alone, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            min_new_tokens=max_new_tokens, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


class Cluster:
    """Target, draft and orchestrator servers in one background event loop."""

    def __init__(self, target_dir: str, draft_dir: str, dtype: str = "float32", cache_mb: int = 0,
                 draft_options=None, k: int = 4, adaptive: bool = False, pipeline: bool = True,
                 draft_fallback: bool = True, redis_url: str = REDIS_URL, max_concurrent_requests: int = 0,
                 tokenizer: str = "", prefill_overlap: bool | None = True, target_linear: str = "auto",
                 inline_compute: str = "auto", relay: bool = True, relay_address: str = "", tree_width: int | None = 4,
                 target_graphs: str = "auto", prefix_cache=None, api_keys_file: str = "", target_batch: int | None = None,
                 quotas=None, service_tls=None, orchestrator=None, target_replicas: int = 1, draft_replicas: int = 1,
                 prefill_chunk: int = 6):
        # relay: on in the test clusters (the server's default is off), so that
        # every end-to-end test runs through it as well as tests/test_relay.py.
        # tree_width: 4, where the server's auto gives these float32 models 0, so
        # that every greedy end-to-end test on a target that verifies trees
        # (target_batch=1 on a CPU) verifies alternatives as well as
        # tests/test_tree.py; a target that batches verifies (the default on a
        # CPU) verifies the block alone, and the orchestrator then drafts no
        # alternatives (ModelInfo.block_only) (None: auto). target_graphs: the target service's
        # --graphs; auto replays CUDA graphs on a GPU (TANDEM_TEST_DEVICE=cuda),
        # whose verify takes the block alone (no alternatives). service_tls: the
        # model services' tandem.tls.ServerTls ("server") and the orchestrator's
        # service_tls_* settings (ca, cert, key, server_name). orchestrator: more
        # OrchestratorConfig fields, by name. target_replicas, draft_replicas:
        # servers of each service (orchestrator.replicas); self.target and
        # self.draft are the first's servicers, self.targets and self.drafts
        # all, self.target_servers and self.draft_servers their gRPC servers.
        # prefill_chunk: the model services' (512 by default), here small, so
        # that the end-to-end tests' prompts of a few tokens run in chunks too.
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers = []
        self.params = dict(target_dir=target_dir, draft_dir=draft_dir, dtype=dtype, cache_mb=cache_mb,
                           draft_options=draft_options, k=k, adaptive=adaptive, pipeline=pipeline,
                           draft_fallback=draft_fallback, redis_url=redis_url,
                           max_concurrent_requests=max_concurrent_requests, tokenizer=tokenizer,
                           prefill_overlap=prefill_overlap, target_linear=target_linear,
                           inline_compute=inline_compute, relay=relay, relay_address=relay_address,
                           tree_width=tree_width, target_graphs=target_graphs, prefix_cache=prefix_cache,
                           api_keys_file=api_keys_file, target_batch=target_batch,
                           quotas=quotas, service_tls=service_tls or {}, orchestrator=orchestrator or {},
                           target_replicas=target_replicas, draft_replicas=draft_replicas, prefill_chunk=prefill_chunk)
        self.run(self._start())

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self):
        from draft_service.server import DraftOptions, build_server as build_draft
        from orchestrator.policy import KPolicyConfig
        from orchestrator.config import PrefixCacheConfig, QuotaConfig
        from orchestrator.server import OrchestratorConfig, build_server as build_orch
        from target_service.server import build_server as build_target

        p = self.params
        cache = CacheConfig(budget_mb=p["cache_mb"], session_ttl_s=0)
        self.targets, self.drafts, self.target_servers, self.draft_servers = [], [], [], []
        target_addresses, draft_addresses = [], []
        for _ in range(p["target_replicas"]):
            target, target_port, _, servicer = build_target(
                "127.0.0.1:0", ModelConfig(p["target_dir"], device=DEVICE, dtype=p["dtype"],
                                           linear=p["target_linear"], inline_compute=p["inline_compute"],
                                           prefill_chunk=p["prefill_chunk"]),
                cache, graphs=p["target_graphs"], batch_verifies=p["target_batch"],
                tls=p["service_tls"].get("server"))
            await target.start()
            self.targets.append(servicer)
            self.target_servers.append(target)
            target_addresses.append(f"127.0.0.1:{target_port}")
        for _ in range(p["draft_replicas"]):
            draft, draft_port, _, servicer = build_draft(
                "127.0.0.1:0", ModelConfig(p["draft_dir"], device=DEVICE, dtype=p["dtype"],
                                           inline_compute=p["inline_compute"], prefill_chunk=p["prefill_chunk"]),
                cache,
                p["draft_options"] or DraftOptions(), tls=p["service_tls"].get("server"))
            await draft.start()
            self.drafts.append(servicer)
            self.draft_servers.append(draft)
            draft_addresses.append(f"127.0.0.1:{draft_port}")
        self.target, self.draft = self.targets[0], self.drafts[0]
        self.servers += self.target_servers + self.draft_servers
        self.target_address = ",".join(target_addresses)
        self.draft_address = ",".join(draft_addresses)
        config = OrchestratorConfig(
            draft_address=self.draft_address, target_address=self.target_address, redis_url=p["redis_url"],
            policy=KPolicyConfig(k=p["k"], k_min=1, k_max=8, adaptive=p["adaptive"]), pipeline=p["pipeline"],
            draft_fallback=p["draft_fallback"], max_concurrent_requests=p["max_concurrent_requests"],
            tokenizer=p["tokenizer"], prefill_overlap=p["prefill_overlap"], relay=p["relay"],
            relay_address=p["relay_address"], tree_width=p["tree_width"],
            prefix_cache=p["prefix_cache"] or PrefixCacheConfig(), api_keys_file=p["api_keys_file"],
            quotas=p["quotas"] or QuotaConfig(),
            **{f"service_tls_{k}": v for k, v in p["service_tls"].items() if k != "server"},
            **p["orchestrator"],
        )
        orch, orch_port, _, self.orchestrator = build_orch("127.0.0.1:0", config)
        await orch.start()
        self.servers.append(orch)
        self.address = f"127.0.0.1:{orch_port}"

    def client(self, tenant=None, api_key=None):
        from tandem.client import TandemClient

        return TandemClient(self.address, tenant=tenant, timeout_s=120, api_key=api_key)

    def stop(self):
        async def stop_all():
            for target in self.targets:
                await target.relay.close()
            for server in self.servers:
                await server.stop(0)
            await self.orchestrator.close()

        self.run(stop_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="session")
def same_cluster(tiny_models):
    """Draft = target: every draft token is accepted."""
    cluster = Cluster(tiny_models["target"], tiny_models["target"])
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def random_cluster(tiny_models):
    """An unrelated random draft: almost nothing is accepted."""
    cluster = Cluster(tiny_models["target"], tiny_models["other"])
    yield cluster
    cluster.stop()
