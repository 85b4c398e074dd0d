"""GET /metrics on the HTTP API: the orchestrator's Prometheus metrics on the
port its OpenAI clients use, as vLLM and TGI serve them, counting a real
completion as its usage says; a 404 naming --metrics-port while they are off."""
import json
import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS
from prometheus_client.parser import text_string_to_metric_families

from tandem import telemetry
from tandem.cli import telemetry_config
from tandem.cli_flags import build_parser
from tandem.launch import free_port
from tests.conftest import REDIS_URL, Cluster
from tests.test_cli import COMMANDS
from tests.test_http_api import _gateway, client


@pytest.fixture(scope="module")
def http(char_models):
    """(cluster, base URL): the character-level pair, and the HTTP gateway in front of its orchestrator."""
    cluster = Cluster(char_models["target"], char_models["draft"])
    base, stop = _gateway(cluster, "tandem-tiny")
    yield cluster, base
    stop()
    cluster.stop()


@pytest.fixture
def metrics_on_http():
    """Metrics on, as `--metrics-port` equal to `--http-port` turns them on: no server of their own."""
    handle = telemetry.setup(telemetry.TelemetryConfig("tandem-orchestrator", http_metrics=True), set_global=False)
    yield
    handle.shutdown()


ACCEPTS = ("", "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
           "text/plain;version=1.0.0;escaping=underscores")


def scrape(base: str, accept: str = "") -> tuple[str, str]:
    """(content type, body) of GET base/metrics, asking for `accept`."""
    request = urllib.request.Request(f"{base}/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.headers["Content-Type"], reply.read().decode()


def samples(text: str) -> dict:
    """(sample name, frozenset(labels)) -> value, from Prometheus' text format,
    without the labels OpenTelemetry's exporter adds to each (otel_scope_name...)."""
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope_"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_on_the_http_port_count_a_completion_as_its_usage_says(http, metrics_on_http):
    _, base = http
    answer = client(base).completions.create(model="tandem-tiny", prompt="def fib(n):", max_tokens=12, temperature=0)
    content_type, text = scrape(base)
    assert content_type == CONTENT_TYPE_PLAIN_0_0_4  # prometheus_client's answer to no Accept header
    got = samples(text)
    assert got["tandem_requests_total", frozenset({("finish_reason", "length")})] == 1
    assert got["tandem_completion_tokens_total", frozenset()] == answer.usage.completion_tokens == 12
    assert got["tandem_prompt_tokens_total", frozenset()] == answer.usage.prompt_tokens > 0
    assert got["tandem_drafts_total", frozenset()] == answer.tandem["rounds"]
    # A scrape is counted as /health is, by its route, once it is answered: the next scrape shows it.
    counted = {labels: value for (name, labels), value in samples(scrape(base)[1]).items()
               if name == "tandem_http_requests_total"}
    assert counted == {frozenset({("method", "POST"), ("route", "/v1/completions"), ("status", "200")}): 1,
                       frozenset({("method", "GET"), ("route", "/metrics"), ("status", "200")}): 1}


def test_a_scraper_that_asks_for_openmetrics_gets_it(http, metrics_on_http):
    _, base = http
    client(base).completions.create(model="tandem-tiny", prompt="abc", max_tokens=2, temperature=0)
    content_type, text = scrape(base, ACCEPTS[1])
    assert content_type.startswith(OPENMETRICS.split(";")[0]) and text.endswith("# EOF\n")
    assert "# TYPE tandem_requests counter" in text and "\ntandem_requests_total{" in text


def test_the_http_port_serves_what_the_metrics_port_serves(http):
    _, base = http
    port = free_port()
    handle = telemetry.setup(telemetry.TelemetryConfig("tandem-orchestrator", metrics_port=port), set_global=False)
    try:
        client(base).completions.create(model="tandem-tiny", prompt="abc", max_tokens=4, temperature=0)
        own = [scrape(f"http://127.0.0.1:{port}", accept) for accept in ACCEPTS]
        over_http = [scrape(base, accept) for accept in ACCEPTS]
    finally:
        handle.shutdown()
    assert [content_type for content_type, _ in own] == [content_type for content_type, _ in over_http]
    assert {name for name, _ in samples(own[0][1])} == {name for name, _ in samples(over_http[0][1])}
    assert 'service_name="tandem-orchestrator"' in over_http[0][1]


def test_with_metrics_off_the_http_port_answers_404_naming_the_flag(http):
    _, base = http
    assert not telemetry.instruments().enabled
    with pytest.raises(urllib.error.HTTPError) as refused:
        scrape(base)
    assert refused.value.code == 404
    body = json.load(refused.value)
    assert body["error"]["type"] == "not_found_error" and "--metrics-port" in body["error"]["message"]


def _orchestrator(*flags: str) -> telemetry.TelemetryConfig:
    return telemetry_config(build_parser().parse_args(["serve", "orchestrator", *flags]))


def test_the_flags_choose_where_metrics_are_served():
    assert not _orchestrator().metrics and not _orchestrator("--http-port", "8000").metrics
    alone = _orchestrator("--http-port", "8000", "--metrics-port", "8000")
    assert (alone.metrics, alone.metrics_port, alone.http_metrics) == (True, 0, True)
    both = _orchestrator("--http-port", "8000", "--metrics-port", "9090")
    assert (both.metrics_port, both.http_metrics) == (9090, False)
    assert not _orchestrator("--http-port", "0", "--metrics-port", "0").metrics
    help_text = " ".join(COMMANDS["tandem serve orchestrator"].format_help().split())
    assert "/metrics while --metrics-port turns metrics on" in help_text
    assert "equal to --http-port serves them there alone" in help_text


def test_the_orchestrator_process_serves_metrics_on_its_http_port_alone(http):
    """`tandem serve orchestrator --http-port P --metrics-port P`: one port, the API and its metrics."""
    cluster, _ = http
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "orchestrator", "--port", "0", "--draft",
         cluster.draft_address, "--target", cluster.target_address, "--redis-url", REDIS_URL, "--wait", "60",
         "--http-port", str(port), "--metrics-port", str(port), "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert select.select([process.stdout], [], [], 120)[0], "the orchestrator did not start in 120 s"
        assert process.stdout.readline().startswith("HTTP "), process.stderr.read()
        base = f"http://127.0.0.1:{port}"
        answer = client(base).completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
        got = samples(scrape(base)[1])
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert got["tandem_completion_tokens_total", frozenset()] == answer.usage.completion_tokens == 5
