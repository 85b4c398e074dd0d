"""`tandem batch`: a file of OpenAI batch requests run against the HTTP API
as a process, over real HTTP and gRPC with the character-level pair: each
answer is what the same request gets on its own, in the input's order, and a
line that is not a request, or is refused, is told apart."""
import json
import subprocess
import sys

from tests.test_http_api import client, http  # noqa: F401 (a fixture)


def test_a_batch_file_gets_each_requests_own_answer_in_order(http, tmp_path):  # noqa: F811
    _, base, _ = http
    chat = {"model": "tandem-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10,
            "temperature": 0}
    completion = {"model": "tandem-tiny", "prompt": "def fib(n):\n    ", "max_tokens": 12, "temperature": 0}
    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": completion},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {**completion, "max_tokens": 0}},
        {"custom_id": "where", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "streamed", "method": "POST", "url": "/v1/completions", "body": {**completion, "stream": True}},
        *[{"custom_id": f"n{i}", "method": "POST", "url": "/v1/completions",
           "body": {**completion, "prompt": f"x = {i}\n", "max_tokens": 6}} for i in range(6)],
    ]
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")
    output = tmp_path / "results.jsonl"
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "batch", str(source), "-o", str(output),
                           "--url", f"{base}/v1", "--concurrency", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # some lines failed
    assert "8 of 12 requests answered 200" in done.stderr
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines] + [None]
    api = client(base)
    expected_chat = api.chat.completions.create(**chat).choices[0].message.content
    expected_completion = api.completions.create(**completion).choices[0].text
    assert results[0]["response"]["status_code"] == 200 and results[0]["error"] is None
    assert results[0]["response"]["body"]["choices"][0]["message"]["content"] == expected_chat
    assert results[1]["response"]["body"]["choices"][0]["text"] == expected_completion
    assert results[1]["response"]["body"]["id"] == f"cmpl-{results[1]['response']['request_id']}"
    assert results[2]["response"]["status_code"] == 400 and results[2]["response"]["body"]["error"]["param"]
    assert results[3]["response"] is None and results[3]["error"]["code"] == "invalid_url"
    assert results[4]["response"] is None and "cannot stream" in results[4]["error"]["message"]
    for i, result in enumerate(results[5:11]):
        alone = api.completions.create(**{**completion, "prompt": f"x = {i}\n", "max_tokens": 6}).choices[0].text
        assert result["response"]["body"]["choices"][0]["text"] == alone
    assert results[11]["error"]["code"] == "invalid_json"
    assert len({r["id"] for r in results}) == len(results)
