"""API keys: who a caller is (DESIGN §1: the orchestrator authenticates tenants).

Without keys (the default) a call's tenant is what its "x-tandem-tenant"
metadata says, trusted as it is. With `--api-keys FILE`, every call that
touches sessions must carry "authorization: Bearer KEY" (the HTTP API passes
its Authorization header on), and the key decides the tenant.

The file holds one key a line, "TENANT KEY", with blank lines and lines
starting with "#" ignored. Only the keys' SHA-256 digests are kept in memory.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

TENANT_KEY = "x-tandem-tenant"
DEFAULT_TENANT = "default"
AUTH_KEY = "authorization"
MIN_KEY_CHARS = 16  # shorter keys are accepted with a warning: they can be guessed


class ApiKeys:
    def __init__(self, tenants_by_digest: dict[str, str]):
        if not tenants_by_digest:
            raise ValueError("no API keys: give at least one 'TENANT KEY' line")
        self._tenants = dict(tenants_by_digest)

    @staticmethod
    def _digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    @classmethod
    def parse(cls, text: str, source: str = "the API keys") -> "ApiKeys":
        """ValueError with the line's number for a line that is not "TENANT KEY",
        or a key given twice."""
        tenants: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{source}, line {number}: expected 'TENANT KEY', got {len(parts)} fields")
            tenant, key = parts
            digest = cls._digest(key)
            if digest in tenants:
                raise ValueError(f"{source}, line {number}: this key was already given (to tenant "
                                 f"{tenants[digest]!r})")
            if len(key) < MIN_KEY_CHARS:
                log.warning("%s, line %d: the key of tenant %r has %d characters; use %d or more",
                            source, number, tenant, len(key), MIN_KEY_CHARS)
            tenants[digest] = tenant
        return cls(tenants)

    @classmethod
    def load(cls, path: str | Path) -> "ApiKeys":
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(f"cannot read the API keys file {path}: {err.strerror}") from err
        return cls.parse(text, str(path))

    def __len__(self) -> int:
        return len(self._tenants)

    def tenant_of(self, key: str) -> str | None:
        return self._tenants.get(self._digest(key))


def bearer(metadata) -> str | None:
    """The key of an "authorization: Bearer KEY" pair in a call's metadata, or None."""
    for name, value in metadata or ():
        if name == AUTH_KEY:
            scheme, _, key = value.partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                return key.strip()
    return None


async def call_tenant(context, keys: ApiKeys | None) -> str:
    """The tenant of a call: its x-tandem-tenant metadata (else "default"), or
    with `keys` its key's, which the call must carry (the rpc ends with
    UNAUTHENTICATED without a valid one, and with PERMISSION_DENIED when its
    tenant metadata names another tenant)."""
    metadata = context.invocation_metadata() or ()
    named = next((value for name, value in metadata if name == TENANT_KEY and value), None)
    if keys is None:
        return named or DEFAULT_TENANT
    key = bearer(metadata)
    if key is None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "this server needs an API key: send the metadata 'authorization: Bearer KEY' "
                            "(HTTP: the Authorization header)")
    tenant = keys.tenant_of(key)
    if tenant is None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the API key is not valid")
    if named is not None and named != tenant:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"the API key is tenant {tenant!r}'s, and the call names tenant {named!r}")
    return tenant
