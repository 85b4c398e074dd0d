"""Stored documents (the Tandem API's PutStoredResponse, GetStoredResponse and
DeleteStoredResponse, and their items' AppendStoredItems, GetStoredItems and
DeleteStoredItem; the rpcs, StoredRpcs): JSON documents in Redis under their
tenant, each with its time to live. The HTTP API keeps each Response of
/v1/responses here with the conversation it answered, and reads it back for
previous_response_id (orchestrator/responses_routes.py), and each
conversation's metadata and items (orchestrator/conversations.py); to the
orchestrator a document is opaque.

Keys: tandem:{tenant}:response:{id}         string: the document (JSON), expiring
      tandem:{tenant}:response:{id}:items   list: its items (ItemStore; a conversation's), expiring with it
"""
from __future__ import annotations

import json
import re

import grpc
import redis.asyncio as redis

from orchestrator.guards import store_unavailable
from tandem.v1 import tandem_pb2

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
        """Keeps the document (replacing one of the same id), and gives its
        items the same time to live; returns it."""
        key = self._key(tenant, response_id)
        try:
            body = json.loads(body_json)
        except json.JSONDecodeError as err:
            raise ValueError(f"the stored response is not valid JSON: {err}") from err
        if not isinstance(body, dict):
            raise ValueError("the stored response must be a JSON object")
        ttl = ttl_s or self.default_ttl_s
        async with self.redis.pipeline(transaction=True) as pipe:  # its items (if any) live as long
            await pipe.set(key, body_json, ex=ttl).expire(f"{key}:items", ttl).execute()
        return ttl

    async def get(self, tenant: str, response_id: str) -> str | None:
        raw = await self.redis.get(self._key(tenant, response_id))
        return None if raw is None else raw.decode()

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Deletes the document, and its items (ItemStore) if it has any."""
        key = self._key(tenant, response_id)
        return bool(await self.redis.delete(key, f"{key}:items"))


# Appends to an existing document's items and refreshes both keys' time to
# live. KEYS: the document, its items. ARGV: ttl, then the items. Returns the
# list's length, or -1 where the document is not there.
_APPEND_ITEMS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local length = redis.call('LLEN', KEYS[2])
for i = 2, #ARGV, 1024 do
  length = redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 1023, #ARGV)))
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
if length > 0 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
return length
"""
# Removes the item whose "id" is ARGV[1] from KEYS[1]; returns 1, or 0 where none is.
_DELETE_ITEM = """
local items = redis.call('LRANGE', KEYS[1], 0, -1)
for _, raw in ipairs(items) do
  local ok, item = pcall(cjson.decode, raw)
  if ok and type(item) == 'table' and item['id'] == ARGV[1] then
    redis.call('LREM', KEYS[1], 1, raw)
    return 1
  end
end
return 0
"""


class ItemStore:
    """A stored document's list of items (AppendStoredItems, GetStoredItems,
    DeleteStoredItem): tandem:{tenant}:response:{id}:items, a Redis list of
    JSON objects, each with a string "id"."""

    def __init__(self, documents: ResponseStore):
        self.documents = documents
        self._append = documents.redis.register_script(_APPEND_ITEMS)
        self._delete = documents.redis.register_script(_DELETE_ITEM)

    def _keys(self, tenant: str, response_id: str) -> list[str]:
        document = self.documents._key(tenant, response_id)
        return [document, f"{document}:items"]

    @staticmethod
    def _check(items_json) -> list[str]:
        for raw in items_json:
            try:
                item = json.loads(raw)
            except json.JSONDecodeError as err:
                raise ValueError(f"a stored item is not valid JSON: {err}") from err
            if not isinstance(item, dict) or not isinstance(item.get("id"), str):
                raise ValueError("a stored item must be a JSON object with a string \"id\"")
        return list(items_json)

    async def append(self, tenant: str, response_id: str, items_json, ttl_s: int = 0) -> int | None:
        """The list's length after the append; None where the document is not there."""
        keys = self._keys(tenant, response_id)
        length = await self._append(keys=keys, args=[ttl_s or self.documents.default_ttl_s,
                                                     *self._check(items_json)])
        return None if length < 0 else int(length)

    async def get(self, tenant: str, response_id: str) -> list[str] | None:
        document, items = self._keys(tenant, response_id)
        async with self.documents.redis.pipeline(transaction=True) as pipe:
            exists, raw = await pipe.exists(document).lrange(items, 0, -1).execute()
        return [r.decode() for r in raw] if exists else None

    async def delete(self, tenant: str, response_id: str, item_id: str) -> bool:
        return bool(await self._delete(keys=self._keys(tenant, response_id)[1:], args=[item_id]))


class StoredRpcs:
    """The orchestrator's rpcs of stored documents and their items, for the
    caller's tenant (the servicer has `responses`, `items` and `_tenant`).
    A bad id or document is INVALID_ARGUMENT, a missing one NOT_FOUND."""

    async def _on_store(self, context, method, response_id: str, *args, found: bool = False):
        """method(tenant, response_id, *args); `found`: a None answer (no such
        document) is NOT_FOUND."""
        tenant = await self._tenant(context)
        try:
            answer = await method(tenant, response_id, *args)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if found and answer is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no stored document {response_id!r} (never stored, "
                                                           "deleted, expired, or another tenant's)")
        return answer

    @store_unavailable
    async def PutStoredResponse(self, request, context):
        ttl = await self._on_store(context, self.responses.put, request.response_id, request.body_json,
                                   request.ttl_seconds)
        return tandem_pb2.PutStoredResponseReply(ttl_seconds=ttl)

    @store_unavailable
    async def GetStoredResponse(self, request, context):
        body = await self._on_store(context, self.responses.get, request.response_id, found=True)
        return tandem_pb2.StoredResponse(response_id=request.response_id, body_json=body)

    @store_unavailable
    async def DeleteStoredResponse(self, request, context):
        deleted = await self._on_store(context, self.responses.delete, request.response_id)
        return tandem_pb2.DeleteStoredResponseReply(deleted=deleted)

    @store_unavailable
    async def AppendStoredItems(self, request, context):
        length = await self._on_store(context, self.items.append, request.response_id, request.items_json,
                                      request.ttl_seconds, found=True)
        return tandem_pb2.StoredItemsReply(length=length)

    @store_unavailable
    async def GetStoredItems(self, request, context):
        items = await self._on_store(context, self.items.get, request.response_id, found=True)
        return tandem_pb2.StoredItems(response_id=request.response_id, items_json=items)

    @store_unavailable
    async def DeleteStoredItem(self, request, context):
        deleted = await self._on_store(context, self.items.delete, request.response_id, request.item_id)
        return tandem_pb2.DeleteStoredResponseReply(deleted=deleted)
