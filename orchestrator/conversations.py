"""OpenAI's Conversations API on the HTTP gateway (/v1/conversations), and
the input items that it and the stored responses keep (`input_items`, listed
a `page` at a time). A conversation is a stored document (its metadata) with
a list of items (messages, function calls and their outputs), both in the
orchestrator's Redis under the caller's tenant, living --response-ttl from
their last change (the Tandem API's PutStoredResponse and AppendStoredItems).
A Responses request with `"conversation": ID` answers its items and its own
input, then adds that input and its output to it, atomically
(responses_routes)."""
from __future__ import annotations

import json
import time
import uuid

import grpc
from aiohttp import web

from orchestrator.openai_params import ApiError, invalid
from orchestrator.openai_responses import check_items
from tandem.v1 import tandem_pb2

TIMEOUT_S = 10.0
MAX_ITEMS = 20  # items a create or an add may carry at once, as OpenAI's
MAX_METADATA = 16  # metadata pairs, as OpenAI's
ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(body: dict) -> list[dict]:
    """The request's `input` (checked by responses_call) as items to keep: each
    with its type and an id, a message's content as parts."""
    given = body["input"]
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    items = []
    for item in given:
        kind = item.get("type", "message")
        item = {"id": f"{ITEM_PREFIX[kind]}_{uuid.uuid4().hex}", **item, "type": kind}
        if kind == "message" and isinstance(item["content"], str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        items.append(item)
    return items


def page(items: list[dict], query) -> dict:
    """A page of items as OpenAI lists them: `limit` (1-100, 20) items in
    `order` ("desc", the default, or "asc"), after the item `after`."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, f"'limit' must be an integer in [1, 100], not {query.get('limit')!r}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"'order' must be 'asc' or 'desc', not {order!r}", param="order")
    if order == "desc":
        items = items[::-1]
    if "after" in query:
        ids = [item.get("id") for item in items]
        if query["after"] not in ids:
            raise ApiError(400, f"'after' names no item here: {query['after']!r}", param="after")
        items = items[ids.index(query["after"]) + 1:]
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}


def _metadata(body: dict) -> dict:
    metadata = body.get("metadata")
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or \
            not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise invalid("metadata", f"'metadata' must be an object of at most {MAX_METADATA} string values")
    return metadata


def _new_items(body: dict, required: bool) -> list[dict]:
    """The body's `items`, checked, as stored items (ids and parts)."""
    items = body.get("items")
    if items is None and not required:
        return []
    check_items(items, "items")
    if len(items) > MAX_ITEMS or (required and not items):
        raise invalid("items", f"'items' holds 1 to {MAX_ITEMS} items at a time")
    return input_items({"input": items}) if items else []


class Conversations:
    """The conversations' routes, on a Gateway (its stub, its request metadata)."""

    def __init__(self, gateway):
        self.gateway = gateway

    def routes(self) -> list:
        return [
            web.post("/v1/conversations", self.create),
            web.get("/v1/conversations/{id}", self.retrieve),
            web.post("/v1/conversations/{id}", self.update),
            web.delete("/v1/conversations/{id}", self.delete),
            web.get("/v1/conversations/{id}/items", self.list_items),
            web.post("/v1/conversations/{id}/items", self.add_items),
            web.get("/v1/conversations/{id}/items/{item}", self.item),
            web.delete("/v1/conversations/{id}/items/{item}", self.delete_item),
        ]

    async def call(self, request: web.Request, rpc: str, message, what: str):
        """One of the orchestrator's stored-document rpcs for the request's
        caller; NOT_FOUND is a 404 that says `what` was not found."""
        try:
            return await getattr(self.gateway.stub, rpc)(message, metadata=self.gateway.metadata(request),
                                                         timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                raise ApiError(404, f"{what} was not found: it was deleted, expired (the orchestrator's "
                                    "--response-ttl after its last change) or is another tenant's",
                               "not_found_error", code="not_found") from err
            raise ApiError.from_rpc(err) from err

    async def conversation(self, request: web.Request, conversation_id: str) -> dict:
        stored = await self.call(request, "GetStoredResponse", tandem_pb2.StoredResponseRef(
            response_id=conversation_id), f"the conversation {conversation_id!r}")
        found = json.loads(stored.body_json)
        if found.get("object") != "conversation":  # a stored response's id, say
            raise ApiError(404, f"the conversation {conversation_id!r} was not found", "not_found_error",
                           code="not_found")
        return found

    async def items(self, request: web.Request, conversation_id: str) -> list[dict]:
        """The conversation's items, in order (a 404 where there is none)."""
        await self.conversation(request, conversation_id)
        stored = await self.call(request, "GetStoredItems", tandem_pb2.StoredResponseRef(
            response_id=conversation_id), f"the conversation {conversation_id!r}")
        return [json.loads(raw) for raw in stored.items_json]

    async def append(self, request: web.Request, conversation_id: str, items: list[dict]) -> None:
        await self.call(request, "AppendStoredItems", tandem_pb2.StoredItems(
            response_id=conversation_id, items_json=[json.dumps(i, ensure_ascii=False) for i in items]),
            f"the conversation {conversation_id!r}")

    async def _put(self, request: web.Request, conversation: dict) -> None:
        await self.call(request, "PutStoredResponse", tandem_pb2.StoredResponse(
            response_id=conversation["id"], body_json=json.dumps(conversation, ensure_ascii=False)),
            "the conversation")

    # --- routes ------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        body = await self.gateway.body(request)
        if not isinstance(body, dict):
            raise invalid(None, "the request body must be a JSON object")
        conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "conversation", "created_at": int(time.time()),
                        "metadata": _metadata(body)}
        items = _new_items(body, required=False)
        await self._put(request, conversation)
        if items:
            await self.append(request, conversation["id"], items)
        return web.json_response(conversation)

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(await self.conversation(request, request.match_info["id"]))

    async def update(self, request: web.Request) -> web.Response:
        """Replaces the metadata (the only thing a conversation has to update)."""
        body = await self.gateway.body(request)
        if not isinstance(body, dict) or "metadata" not in body:
            raise invalid("metadata", "an update gives the conversation's 'metadata'")
        conversation = await self.conversation(request, request.match_info["id"])
        conversation["metadata"] = _metadata(body)
        await self._put(request, conversation)
        return web.json_response(conversation)

    async def delete(self, request: web.Request) -> web.Response:
        conversation_id = request.match_info["id"]
        await self.conversation(request, conversation_id)
        await self.call(request, "DeleteStoredResponse", tandem_pb2.StoredResponseRef(
            response_id=conversation_id), "the conversation")
        return web.json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: web.Request) -> web.Response:
        return web.json_response(page(await self.items(request, request.match_info["id"]), request.query))

    async def add_items(self, request: web.Request) -> web.Response:
        body = await self.gateway.body(request)
        if not isinstance(body, dict):
            raise invalid(None, "the request body must be a JSON object")
        items = _new_items(body, required=True)
        await self.conversation(request, request.match_info["id"])
        await self.append(request, request.match_info["id"], items)
        return web.json_response({"object": "list", "data": items, "first_id": items[0]["id"],
                                  "last_id": items[-1]["id"], "has_more": False})

    async def item(self, request: web.Request) -> web.Response:
        wanted = request.match_info["item"]
        for item in await self.items(request, request.match_info["id"]):
            if item.get("id") == wanted:
                return web.json_response(item)
        raise ApiError(404, f"the conversation has no item {wanted!r}", "not_found_error", code="not_found")

    async def delete_item(self, request: web.Request) -> web.Response:
        """Removes an item; answers the conversation, as OpenAI does."""
        conversation = await self.conversation(request, request.match_info["id"])
        reply = await self.call(request, "DeleteStoredItem", tandem_pb2.StoredItemRef(
            response_id=conversation["id"], item_id=request.match_info["item"]), "the conversation")
        if not reply.deleted:
            raise ApiError(404, f"the conversation has no item {request.match_info['item']!r}", "not_found_error",
                           code="not_found")
        return web.json_response(conversation)
