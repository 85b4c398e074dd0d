"""`tandem batch`: a file of OpenAI batch requests run against a Tandem
server's HTTP API, as OpenAI's Batch API and vLLM's run_batch take them.

Each input line is {"custom_id", "method": "POST", "url", "body"}, url one of
/v1/chat/completions, /v1/completions and /v1/responses. Each output line, in
the input's order, is {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}: a request the server answered has its
response (an error status with the server's error body, too); one that never
got an answer (a line that is not a request, a server that went away) has
"response": null and "error": {"code", "message"}. Streaming is refused per
line. Requests run `--concurrency` at a time, so the orchestrator batches
them as it does any concurrent requests."""
from __future__ import annotations

import asyncio
import json
import sys
import uuid

import aiohttp
from tqdm import tqdm

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def _error(custom_id, code: str, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _request(number: int, line: str) -> tuple[object, str, dict] | dict:
    """(custom_id, url, body), or the output line of a line that is not a request."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as err:
        return _error(None, "invalid_json", f"line {number}: not JSON: {err}")
    if not isinstance(request, dict):
        return _error(None, "invalid_request", f"line {number}: not a JSON object")
    custom_id = request.get("custom_id")
    if request.get("method", "POST") != "POST":
        return _error(custom_id, "invalid_request", f"line {number}: method must be POST")
    url, body = request.get("url"), request.get("body")
    if url not in URLS:
        return _error(custom_id, "invalid_url", f"line {number}: url must be one of {', '.join(URLS)}, not {url!r}")
    if not isinstance(body, dict):
        return _error(custom_id, "invalid_request", f"line {number}: body must be a JSON object")
    if body.get("stream"):
        return _error(custom_id, "invalid_request", f"line {number}: a batch request cannot stream")
    return custom_id, url, body


async def _send(session: aiohttp.ClientSession, base: str, custom_id, url: str, body: dict) -> dict:
    request_id = uuid.uuid4().hex
    try:
        async with session.post(f"{base}{url}", json=body, headers={"X-Request-Id": request_id}) as reply:
            try:
                answer = await reply.json(content_type=None)
            except (json.JSONDecodeError, aiohttp.ContentTypeError):
                answer = {"error": {"message": (await reply.text())[:1000], "type": "invalid_response"}}
            return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                    "response": {"status_code": reply.status,
                                 "request_id": reply.headers.get("X-Request-Id", request_id), "body": answer},
                    "error": None}
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        return _error(custom_id, "request_failed", f"{type(err).__name__}: {err}")


async def run(lines: list[str], base: str, concurrency: int, api_key: str | None, timeout_s: float,
              progress: bool = True) -> list[dict]:
    """The output lines of the input lines, in order."""
    parsed = [_request(i + 1, line) for i, line in enumerate(lines)]
    results: list[dict | None] = [p if isinstance(p, dict) else None for p in parsed]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(lines), unit="req", disable=not progress, file=sys.stderr)
    bar.update(sum(r is not None for r in results))

    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def one(index: int, custom_id, url: str, body: dict) -> None:
            async with limit:
                results[index] = await _send(session, base, custom_id, url, body)
            bar.update(1)

        await asyncio.gather(*(one(i, *p) for i, p in enumerate(parsed) if not isinstance(p, dict)))
    bar.close()
    return results


def main(args) -> int:
    """Reads args.input (a path, or - for stdin), writes args.output (or
    stdout); returns 0 when every request got a 200, else 1."""
    if args.input == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(args.input, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            print(f"tandem batch: {args.input}: {err.strerror or err}", file=sys.stderr)
            return 2
    lines = [line for line in text.splitlines() if line.strip()]
    base = args.url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    results = asyncio.run(run(lines, base, args.concurrency, args.api_key, args.timeout, progress=not args.quiet))
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for result in results:
            out.write(json.dumps(result, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    failed = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in results)
    print(f"{len(results) - failed} of {len(results)} requests answered 200", file=sys.stderr)
    return 1 if failed else 0
