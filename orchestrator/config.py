"""The orchestrator's configuration, checked on construction.

It imports nothing heavy (no torch, no transformers, no gRPC stubs), so that
`tandem serve orchestrator` rejects bad flags before it loads the rest."""
from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.policy import KPolicyConfig

TRANSPORTS = ("stream", "unary")  # model calls on one stream per service, or unary rpcs
MAX_TREE_WIDTH = 16  # alternatives a verify carries at most
SCHEDULING_POLICIES = ("fcfs", "priority")  # the model services' queues: arrival order, or requests' priority first


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Prefix reuse across stateless requests (orchestrator.prefix_cache)."""

    sessions: int = 32  # finished stateless sessions kept parked at most (the oldest go first); 0 = off
    ttl_s: int = 600  # how long a session stays parked, seconds

    def __post_init__(self):
        if self.sessions < 0:
            raise ValueError(f"prefix cache sessions must be >= 0 (0: off), got {self.sessions}")
        if self.ttl_s < 1:
            raise ValueError(f"prefix cache TTL must be >= 1 s, got {self.ttl_s}")

    @property
    def enabled(self) -> bool:
        return self.sessions > 0


@dataclass(frozen=True)
class QuotaConfig:
    """Per-tenant quotas, across replicas (orchestrator.quotas)."""

    max_requests: int = 0  # Generate and Chat streams a tenant runs at once; 0 = no limit
    tokens_per_minute: int = 0  # tokens a tenant commits a minute (prompts and generated); 0 = no limit

    def __post_init__(self):
        if self.max_requests < 0 or self.tokens_per_minute < 0:
            raise ValueError("tenant quotas must be >= 0 (0: no limit)")

    @property
    def enabled(self) -> bool:
        return bool(self.max_requests or self.tokens_per_minute)


DNS_PREFIX = "dns:///"  # a service's replicas: every address a DNS name resolves to


def split_addresses(value: str) -> list[str]:
    """A service's replicas' addresses from "host:port[,host:port...]"."""
    return [part.strip() for part in value.split(",")]


def dns_target(value: str) -> tuple[str, int]:
    """(host, port) from "dns:///host:port"; ValueError where it is not that."""
    host, _, port = value[len(DNS_PREFIX):].rpartition(":")
    if not host or "," in value or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r}: a DNS name of replicas is {DNS_PREFIX}NAME:PORT")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class OrchestratorConfig:
    # Each service's address, or its replicas' addresses, comma-separated, or
    # a DNS name whose every address is a replica, dns:///NAME:PORT
    # (orchestrator.replicas: each session's calls go to one replica).
    draft_address: str
    target_address: str
    redis_url: str = "redis://127.0.0.1:6379/0"
    tokenizer: str = ""  # path or hub id; "" = the target's model, "none" = token ids only
    policy: KPolicyConfig = field(default_factory=KPolicyConfig)
    pipeline: bool | None = True  # None = auto: per request, the mode expected to be faster (PipelineChoice)
    # A turn's prompt: the draft prefills it beside the target's prefill (True)
    # or before it (False); None = auto: beside it unless the two services
    # share a machine's cores (tandem.placement.shared_cores).
    prefill_overlap: bool | None = None
    default_max_tokens: int = 128
    session_ttl_s: int = 3600
    # How long a stored response (PutStoredResponse: the HTTP API's
    # /v1/responses with "store": true) is kept, seconds.
    response_ttl_s: int = 7 * 24 * 3600
    service_timeout_s: float = 120.0
    # How often this orchestrator shares its sessions on each model replica with
    # the other orchestrators through Redis, and reads theirs (orchestrator.load_board),
    # by which new sessions are placed, seconds; 0: never, each orchestrator then
    # counts only its own sessions. Only with replicas.
    replica_load_s: float = 1.0
    service_transport: str = "stream"  # model calls on one stream per service, or "unary" rpcs
    draft_fallback: bool = True  # while the draft service is down, decode on the target alone
    max_concurrent_requests: int = 128  # Generate and Chat streams at once; more get RESOURCE_EXHAUSTED; 0 = no limit
    # Verifies ask the target to send its verdict's next draft call straight to
    # the draft service (target_service.relay), at relay_address, the draft's
    # address as the target reaches it ("" = draft_address). Off by default: it
    # cut the overhead of rounds after a rejection but has not been shown to
    # raise tokens/s (README, --relay).
    relay: bool = False
    relay_address: str = ""
    # Greedy requests: the draft's runner-ups of a block's first tree_width
    # tokens are verified beside it, in the same forward (a token tree one
    # level off the block); where the target's token at the first rejection is
    # the runner-up there, the round commits one token more. 0 = off; None =
    # auto: the width the target suggests (ModelInfo.tree_width: 4 for bf16 on
    # packed layers with AMX, else 0).
    tree_width: int | None = None
    # A finished Generate without keep_session parks its session, and a later
    # one whose prompt shares its prefix takes it over and prefills only the rest.
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    # A file of "TENANT KEY" lines: every call that touches sessions must carry
    # one of the keys (orchestrator.auth), which names its tenant. "" = none:
    # the x-tandem-tenant metadata is trusted as it is.
    api_keys_file: str = ""
    quotas: QuotaConfig = field(default_factory=QuotaConfig)
    # The model services over TLS: their CA ("" = plaintext), the orchestrator's
    # client certificate and key for services that ask for one, and the name
    # their certificates hold where it is not the addresses' host.
    service_tls_ca: str = ""
    service_tls_cert: str = ""
    service_tls_key: str = ""
    service_tls_server_name: str = ""
    # The chat template's text, in place of the tokenizer's ("" = the
    # tokenizer's); and whether a request may bring its own
    # (ChatMessages.chat_template), which the orchestrator then runs.
    chat_template: str = ""
    trust_request_chat_template: bool = False
    # "fcfs": the model services run calls in arrival order, and a request's
    # priority other than 0 is refused; "priority": a request's calls queue by
    # its GenerationParams.priority, the lowest first (vLLM's --scheduling-policy).
    scheduling_policy: str = "fcfs"
    # Each tenant's priority ("*": every tenant not named): its requests' where
    # they give none, and the earliest they may ask for (priority policy only).
    tenant_priorities: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.default_max_tokens < 1 or self.session_ttl_s < 1:
            raise ValueError("default_max_tokens and session_ttl_s must be >= 1")
        if self.response_ttl_s < 1:
            raise ValueError(f"response_ttl_s must be >= 1, got {self.response_ttl_s}")
        if self.tree_width is not None and not 0 <= self.tree_width <= MAX_TREE_WIDTH:
            raise ValueError(f"tree_width must be in [0, {MAX_TREE_WIDTH}], got {self.tree_width}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.tenant_priorities and self.scheduling_policy != "priority":
            raise ValueError("tenant priorities need the priority scheduling policy (--scheduling-policy priority)")
        if self.max_concurrent_requests < 0:
            raise ValueError(f"max_concurrent_requests must be >= 0 (0: no limit), got {self.max_concurrent_requests}")
        if not self.service_timeout_s > 0:
            raise ValueError(f"service_timeout_s must be > 0, got {self.service_timeout_s}")
        if not self.replica_load_s >= 0:
            raise ValueError(f"--replica-load-interval must be >= 0 seconds, got {self.replica_load_s}")
        if (self.service_tls_cert or self.service_tls_key or self.service_tls_server_name) and not self.service_tls_ca:
            raise ValueError("--service-tls-cert, --service-tls-key and --service-tls-server-name need "
                             "--service-tls-ca: the CA the services' certificates are checked against")
        if bool(self.service_tls_cert) != bool(self.service_tls_key):
            raise ValueError("--service-tls-cert and --service-tls-key go together")
        if self.service_tls_ca and self.relay:
            raise ValueError("--relay on has the target dial the draft, in plaintext: it cannot be combined with "
                             "--service-tls-ca")
        several = False
        for role, value in (("draft", self.draft_address), ("target", self.target_address)):
            if value.startswith(DNS_PREFIX):
                try:
                    dns_target(value)
                except ValueError as err:
                    raise ValueError(f"--{role}: {err}") from None
                several = True
                continue
            addresses = split_addresses(value)
            if not all(addresses):
                raise ValueError(f"--{role}: an empty address in {value!r}")
            if len(set(addresses)) != len(addresses):
                raise ValueError(f"--{role}: an address given twice in {value!r}")
            several |= len(addresses) > 1
        if self.relay and several:
            raise ValueError("--relay on has the target dial one draft address: it cannot be combined with "
                             "replicas of a service")
        if self.service_transport not in TRANSPORTS:
            raise ValueError(f"service_transport must be one of {TRANSPORTS}, got {self.service_transport!r}")
