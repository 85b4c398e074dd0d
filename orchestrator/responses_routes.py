"""The HTTP gateway's routes of OpenAI's Responses API: POST /v1/responses
(a chat completion underneath: orchestrator/openai_responses.py, then
Gateway.answer), and the stored responses.

Unless a request says `"store": false`, its finished Response is kept with
the conversation it answered (its input items, each with an id) in the
orchestrator's Redis under the caller's tenant (`record`; the Tandem API's
PutStoredResponse, for the orchestrator's --response-ttl). A later request
that names it as `previous_response_id` continues that conversation: the
stored input items and output items, then its own `input`
(`previous_items`). Its caches are reused by prefix (the orchestrator's
--prefix-cache), as for any conversation resent whole. GET and DELETE
/v1/responses/{id} read and delete one, and GET .../input_items pages through
its conversation."""
from __future__ import annotations

import json

from aiohttp import web

from orchestrator.openai_params import ApiError
from orchestrator.conversations import TIMEOUT_S, Conversations, input_items, page
from orchestrator.openai_responses import conversation_id, previous_id, responses_call, truncation
from orchestrator.responses_answer import Responses
from tandem.v1 import tandem_pb2



def record(response: dict, items: list[dict]) -> str:
    """What is stored of a Response: itself, and the input items it answered
    (a continued conversation's included)."""
    return json.dumps({"response": response, "input": items}, ensure_ascii=False)


def previous_items(stored: str) -> list[dict]:
    """The conversation a stored response continues into: its input items, then its output."""
    kept = json.loads(stored)
    return [*kept["input"], *kept["response"]["output"]]


async def _named_404(lookup, param: str, message: str):
    """A lookup whose 404 names the request's parameter that asked for it
    (`param`, with code PARAM_not_found less its "_id")."""
    try:
        return await lookup
    except ApiError as err:
        if err.status != 404:
            raise
        raise ApiError(404, message, "invalid_request_error", param,
                       f"{param.removesuffix('_id')}_not_found") from err


class ResponsesRoutes:
    """The routes, on a Gateway (its stub to the orchestrator, its answers)."""

    def __init__(self, gateway):
        self.gateway = gateway
        self.conversations = Conversations(gateway)

    def routes(self) -> list:
        return [
            *self.conversations.routes(),
            web.post("/v1/responses", self.create),
            web.get("/v1/responses/{response_id}", self.retrieve),
            web.delete("/v1/responses/{response_id}", self.delete),
            web.get("/v1/responses/{response_id}/input_items", self.input_items),
            web.post("/v1/responses/{response_id}/cancel", self.cancel),
        ]

    async def create(self, request: web.Request) -> web.StreamResponse:
        gateway = self.gateway
        body = await gateway.body(request)
        previous = []
        conversation = conversation_id(body)
        if conversation is not None:
            previous = await _named_404(self.conversations.items(request, conversation), "conversation",
                                        f"the conversation {conversation!r} was not found")
        elif (continued := previous_id(body)) is not None:
            previous = previous_items(await _named_404(
                self._stored(request, continued), "previous_response_id",
                f"the previous response {continued!r} was not found: it was not stored (\"store\": false), was "
                "deleted, expired (the orchestrator's --response-ttl) or is another tenant's"))
        call = gateway.reasoned(responses_call(body, gateway.tool_call_parser, previous))
        added = input_items(body)
        if truncation(body) == "auto":
            call = await self._fitted(request, body, call, [*previous, *added])
        shape = Responses(body, await gateway.model_name())

        async def keep(final: dict) -> None:
            """Stored (unless "store": false), and its input and output added to its conversation."""
            if shape.store:
                await self.conversations.call(request, "PutStoredResponse", tandem_pb2.StoredResponse(
                    response_id=final["id"], body_json=record(final, [*previous, *added])), "the response")
            if conversation is not None:
                await self.conversations.append(request, conversation, [*added, *final["output"]])

        shape.keeper = keep
        return await gateway.answer(request, call, shape)

    async def _fitted(self, request: web.Request, body: dict, call, items: list[dict]):
        """truncation "auto": the call on the conversation less its oldest
        turns, as few as leave room for the answer in the context window. A
        turn is cut only where a user's message begins, so that no call's output
        is left without its call; the last user message always stays (where even
        that does not fit, the orchestrator's 400 says so)."""
        gateway = self.gateway
        info = await gateway.target_info()
        room = info.max_context - (body.get("max_output_tokens") or info.default_max_tokens)

        async def length(candidate) -> int:
            reply = await gateway.stub.Tokenize(tandem_pb2.TokenizeRequest(messages=candidate.request.messages),
                                                metadata=gateway.metadata(request), timeout=TIMEOUT_S)
            return len(reply.token_ids)

        if await length(call) <= room:
            return call
        cuts = [i for i, item in enumerate(items) if i and item.get("type") == "message" and item.get("role") == "user"]
        calls = {}

        def cut_at(i: int):
            if i not in calls:
                calls[i] = gateway.reasoned(responses_call({**body, "input": items[i:], "previous_response_id": None,
                                                            "conversation": None}, gateway.tool_call_parser))
            return calls[i]

        low, high = 0, len(cuts) - 1  # the fewest turns dropped that fit: the first cut whose call fits
        if not cuts or await length(cut_at(cuts[high])) > room:
            return cut_at(cuts[-1]) if cuts else call
        while low < high:
            middle = (low + high) // 2
            if await length(cut_at(cuts[middle])) <= room:
                high = middle
            else:
                low = middle + 1
        return cut_at(cuts[low])

    async def _stored(self, request: web.Request, response_id: str) -> str:
        """A stored response's record (`record`), or a 404."""
        reply = await self.conversations.call(request, "GetStoredResponse", tandem_pb2.StoredResponseRef(
            response_id=response_id), f"the stored response {response_id!r}")
        return reply.body_json

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}: a stored Response, as it was answered."""
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise ApiError(400, "streaming a stored response is not supported: Tandem keeps finished responses "
                                "only", param="stream")
        stored = json.loads(await self._stored(request, request.match_info["response_id"]))
        return web.json_response(stored["response"])

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        reply = await self.conversations.call(request, "DeleteStoredResponse", tandem_pb2.StoredResponseRef(
            response_id=response_id), "the stored response")
        if not reply.deleted:
            raise ApiError(404, f"no stored response {response_id!r}", "not_found_error", code="not_found")
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}/input_items: the conversation a stored
        Response answered (a continued one's earlier turns included), a page
        of `limit` (1-100, 20) items in `order` ("desc", the default, or
        "asc"), after the item `after`."""
        items = json.loads(await self._stored(request, request.match_info["response_id"]))["input"]
        return web.json_response(page(items, request.query))

    async def cancel(self, request: web.Request) -> web.Response:
        """POST /v1/responses/{id}/cancel: for background responses, which Tandem does not run."""
        await self._stored(request, request.match_info["response_id"])  # a 404 where there is none
        raise ApiError(400, "only a background response can be cancelled, and Tandem runs none: a response is "
                            "done when its request is answered", param="response_id")
