"""Stored responses (the Tandem API's PutStoredResponse, GetStoredResponse and
DeleteStoredResponse): JSON documents in Redis under their tenant, each with
its time to live. The HTTP API keeps each Response of /v1/responses here with
the conversation it answered, and reads it back for previous_response_id
(orchestrator/openai_responses.py); to the orchestrator a document is opaque.

Keys: tandem:{tenant}:response:{id}   string: the document (JSON), expiring
"""
from __future__ import annotations

import json
import re

import redis.asyncio as redis

RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_id(response_id: str) -> str:
    if not RESPONSE_ID.fullmatch(response_id):
        raise ValueError(f"a response id is 1 to 128 letters, digits, '_' or '-', not {response_id[:140]!r}")
    return response_id


class ResponseStore:
    def __init__(self, client: redis.Redis, default_ttl_s: int):
        self.redis = client
        self.default_ttl_s = default_ttl_s

    @staticmethod
    def _key(tenant: str, response_id: str) -> str:
        return f"tandem:{tenant}:response:{check_id(response_id)}"

    async def put(self, tenant: str, response_id: str, body_json: str, ttl_s: int = 0) -> int:
        """Keeps the document (replacing one of the same id); returns its time to live."""
        key = self._key(tenant, response_id)
        try:
            body = json.loads(body_json)
        except json.JSONDecodeError as err:
            raise ValueError(f"the stored response is not valid JSON: {err}") from err
        if not isinstance(body, dict):
            raise ValueError("the stored response must be a JSON object")
        ttl = ttl_s or self.default_ttl_s
        await self.redis.set(key, body_json, ex=ttl)
        return ttl

    async def get(self, tenant: str, response_id: str) -> str | None:
        raw = await self.redis.get(self._key(tenant, response_id))
        return None if raw is None else raw.decode()

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self.redis.delete(self._key(tenant, response_id)))
