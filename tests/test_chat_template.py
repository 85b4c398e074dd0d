"""Chat templates other than the tokenizer's: the orchestrator's --chat-template,
and a request's own (vLLM's chat_template), which only a server run with
--trust-request-chat-template renders. Over real gRPC and HTTP with the
character-level pair, the reply equals Hugging Face's greedy generate on the
target alone over the conversation as that template renders it."""
import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import Cluster, reference_greedy
from tests.test_http_api import _gateway, client

# Neither is the character tokenizer's own ("role: content\n", then "assistant: ").
SERVER_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}")
REQUEST_TEMPLATE = ("{% for m in messages %}<{{ m['role'] | upper }}>{{ m['content'] }}</>{% endfor %}"
                    "{% if add_generation_prompt %}<ASSISTANT>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "count to three"}]


def _rendered(tokenizer, template: str, messages=MESSAGES) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def trusted(char_models):
    """(cluster, base URL, tokenizer): the character pair, the orchestrator on
    SERVER_TEMPLATE and trusting requests' templates, and its HTTP gateway."""
    cluster = Cluster(char_models["target"], char_models["draft"],
                      orchestrator={"chat_template": SERVER_TEMPLATE, "trust_request_chat_template": True})
    base, stop = _gateway(cluster, "tandem-tiny")
    yield cluster, base, AutoTokenizer.from_pretrained(char_models["target"])
    stop()
    cluster.stop()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def test_the_servers_template_renders_every_conversation(trusted, char_models):
    cluster, base, tokenizer = trusted
    assert tokenizer.chat_template != SERVER_TEMPLATE
    prompt = _rendered(tokenizer, SERVER_TEMPLATE)
    expected = reference_greedy(char_models["target"], prompt, 16)
    with cluster.client() as grpc_client:
        result = grpc_client.generate(messages=MESSAGES, max_tokens=16, temperature=0)
        assert result.token_ids == expected and result.prompt_tokens == len(prompt)
        assert list(grpc_client.tokenize(messages=MESSAGES).token_ids) == prompt
        assert grpc_client.server_info().tokenizer.chat_template == SERVER_TEMPLATE
        # A session kept for Chat renders its turns with it too.
        kept = grpc_client.generate(messages=MESSAGES, max_tokens=16, temperature=0, keep_session=True)
        assert kept.token_ids == expected
    answer = client(base).chat.completions.create(model="tandem-tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                                  extra_body={"return_token_ids": True})
    assert answer.choices[0].token_ids == expected and answer.usage.prompt_tokens == len(prompt)
    assert _post(base + "/tokenize", {"messages": MESSAGES})["tokens"] == prompt


def test_a_requests_own_template_renders_that_request_alone(trusted, char_models):
    cluster, base, tokenizer = trusted
    prompt = _rendered(tokenizer, REQUEST_TEMPLATE)
    assert prompt != _rendered(tokenizer, SERVER_TEMPLATE)
    expected = reference_greedy(char_models["target"], prompt, 16)
    with cluster.client() as grpc_client:
        result = grpc_client.generate(messages=MESSAGES, max_tokens=16, temperature=0, chat_template=REQUEST_TEMPLATE)
        assert result.token_ids == expected and result.prompt_tokens == len(prompt)
        assert list(grpc_client.tokenize(messages=MESSAGES, chat_template=REQUEST_TEMPLATE).token_ids) == prompt
        # The next request without one is the server's again.
        assert grpc_client.generate(messages=MESSAGES, max_tokens=4).prompt_tokens == len(
            _rendered(tokenizer, SERVER_TEMPLATE))
    answer = client(base).chat.completions.create(
        model="tandem-tiny", messages=MESSAGES, max_tokens=16, temperature=0,
        extra_body={"chat_template": REQUEST_TEMPLATE, "return_token_ids": True})
    assert answer.choices[0].token_ids == expected and answer.usage.prompt_tokens == len(prompt)
    chunks = list(client(base).chat.completions.create(
        model="tandem-tiny", messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
        extra_body={"chat_template": REQUEST_TEMPLATE, "return_token_ids": True}))
    assert [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])] == expected
    assert _post(base + "/tokenize", {"messages": MESSAGES, "chat_template": REQUEST_TEMPLATE})["tokens"] == prompt


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m['content'] }}", "not a valid Jinja template"),
    ("{{ messages[0]['content'] + 1 }}", "chat template failed: TypeError"),
    ("{{ raise_exception('no system messages here') }}", "no system messages here"),
    ("{{ 'x' }}" * 8000, "over 65536"),
])
def test_a_requests_template_that_cannot_render_is_refused_with_its_reason(trusted, template, words):
    cluster, base, _ = trusted
    with cluster.client() as grpc_client:
        with pytest.raises(grpc.RpcError) as refused:
            grpc_client.generate(messages=MESSAGES, max_tokens=4, chat_template=template)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()
        # and the server goes on serving
        assert grpc_client.generate(messages=MESSAGES, max_tokens=2).completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as refused:
        client(base).chat.completions.create(model="tandem-tiny", messages=MESSAGES, max_tokens=4,
                                             extra_body={"chat_template": template})
    assert words in refused.value.body["message"]


def test_a_requests_template_is_for_stateless_requests_and_must_be_text(trusted):
    cluster, base, _ = trusted
    with cluster.client() as grpc_client:
        with pytest.raises(grpc.RpcError) as refused:
            grpc_client.generate(messages=MESSAGES, max_tokens=4, chat_template=REQUEST_TEMPLATE, keep_session=True)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stateless" in refused.value.details()
    for template in (7, ""):
        with pytest.raises(openai.BadRequestError) as refused:
            client(base).chat.completions.create(model="tandem-tiny", messages=MESSAGES, max_tokens=4,
                                                 extra_body={"chat_template": template})
        assert refused.value.body["param"] == "chat_template"


def test_a_server_that_does_not_trust_requests_templates_refuses_them(char_models):
    cluster = Cluster(char_models["target"], char_models["draft"])
    base, stop = _gateway(cluster, "tandem-tiny")
    try:
        with cluster.client() as grpc_client:
            with pytest.raises(grpc.RpcError) as refused:
                grpc_client.generate(messages=MESSAGES, max_tokens=4, chat_template=REQUEST_TEMPLATE)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--trust-request-chat-template" in refused.value.details()
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(base + "/tokenize", {"messages": MESSAGES, "chat_template": REQUEST_TEMPLATE})
        assert refused.value.code == 400
        with pytest.raises(openai.BadRequestError) as refused:
            client(base).chat.completions.create(model="tandem-tiny", messages=MESSAGES, max_tokens=4,
                                                 extra_body={"chat_template": REQUEST_TEMPLATE})
        assert "--trust-request-chat-template" in refused.value.body["message"]
    finally:
        stop()
        cluster.stop()


def test_the_flag_takes_a_file_or_the_templates_text(tmp_path, char_models):
    from orchestrator.text import chat_template_text, check_chat_template

    path = tmp_path / "template.jinja"
    path.write_text(SERVER_TEMPLATE)
    assert chat_template_text(str(path)) == SERVER_TEMPLATE
    assert chat_template_text(REQUEST_TEMPLATE) == REQUEST_TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    tokenizer = AutoTokenizer.from_pretrained(char_models["target"])
    check_chat_template(tokenizer, SERVER_TEMPLATE)
    check_chat_template(tokenizer, "{{ raise_exception('wants a system message') }}")  # valid; refuses this one
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        check_chat_template(tokenizer, "{% if %}")


def test_a_server_template_that_is_not_jinja_stops_the_orchestrator_at_start_up(tmp_path, trusted):
    """`tandem serve orchestrator --chat-template` with a broken template, or
    a file that is not there, exits with the reason before it serves."""
    import subprocess
    import sys

    cluster, _, _ = trusted
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    for value, words in ((str(bad), "not a valid Jinja template"),
                         (str(tmp_path / "missing.jinja"), "neither a file nor a Jinja template")):
        run = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "orchestrator", "--port", "0",
                              "--chat-template", value, "--draft", cluster.draft_address,
                              "--target", cluster.target_address], capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and words in run.stderr, run.stderr
        assert "PairingError" not in run.stderr and "Traceback" not in run.stderr, run.stderr  # the reason alone
