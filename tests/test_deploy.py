"""The Kubernetes manifests start the services the CLI knows: every
container's args parse, and each serves on the port its probes and Service use."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tandem.cli import build_parser

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"


def _containers():
    """(where, container) for the base's Deployments, and the cpu overlay's args patches."""
    for path in sorted((K8S / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Deployment":
                for container in doc["spec"]["template"]["spec"]["containers"]:
                    if container["image"] != "redis:7":  # the one that is not Tandem
                        yield f"{path.name}:{container['name']}", container, doc
    overlay = yaml.safe_load((K8S / "overlays" / "cpu" / "kustomization.yaml").read_text())
    for patch in overlay["patches"]:
        for op in yaml.safe_load(patch["patch"]):
            if op["path"].endswith("/args"):
                yield f"overlays/cpu:{patch['target']['name']}", {"args": op["value"]}, None


CONTAINERS = list(_containers())


@pytest.mark.parametrize("where, container, deployment", CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_manifest_args_parse_and_ports_match(where, container, deployment):
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve" and args.host == "0.0.0.0"
    if deployment is not None:
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == args.port and ports["metrics"] == args.metrics_port
        assert ports.get("http") == getattr(args, "http_port", None)  # the orchestrator's HTTP API
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == args.port


def test_each_service_exposes_its_deployments_named_ports():
    """A Service per role, forwarding every named port of its Deployment's container
    (the orchestrator's gRPC, HTTP and metrics ports)."""
    for path in sorted((K8S / "base").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        for deployment in (d for d in docs if d["kind"] == "Deployment"):
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            service = services[deployment["metadata"]["name"]]
            forwarded = {p.get("name"): p["targetPort"] for p in service["spec"]["ports"]}
            assert forwarded == {p.get("name"): p["containerPort"] for p in container["ports"]}, path.name


def _with_component(tmp_path, component: str) -> tuple[dict, dict]:
    """The cpu overlay with a component, rendered by kustomize: the
    orchestrator's pod spec and its container."""
    docs = _rendered(tmp_path, component)
    orchestrator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tandem-orchestrator")
    spec = orchestrator["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


def _rendered(tmp_path, component: str) -> list[dict]:
    """The cpu overlay with a component, rendered by kustomize: its documents."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    relative = Path(os.path.relpath(K8S, overlay))
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{relative / 'overlays' / 'cpu'}]\ncomponents: [{relative / 'components' / component}]\n")
    rendered = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    return [d for d in yaml.safe_load_all(rendered.stdout) if d]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize) to render")
def test_the_api_keys_component_gives_the_orchestrator_its_keys_file(tmp_path, monkeypatch):
    """components/api-keys on the cpu overlay: the Secret is mounted where the
    orchestrator's $TANDEM_API_KEYS_FILE points, which its --api-keys reads."""
    spec, container = _with_component(tmp_path, "api-keys")
    env = {e["name"]: e["value"] for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    volume = next(v for v in spec["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "tandem-api-keys" and mount["readOnly"]
    assert Path(env["TANDEM_API_KEYS_FILE"]).parent == Path(mount["mountPath"])
    monkeypatch.setenv("TANDEM_API_KEYS_FILE", env["TANDEM_API_KEYS_FILE"])
    assert build_parser().parse_args(container["args"]).api_keys == env["TANDEM_API_KEYS_FILE"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize) to render")
def test_the_chat_template_component_gives_the_orchestrator_its_template(tmp_path, monkeypatch):
    """components/chat-template: the ConfigMap's template.jinja is mounted
    where $TANDEM_CHAT_TEMPLATE points, which --chat-template reads."""
    spec, container = _with_component(tmp_path, "chat-template")
    env = {e["name"]: e["value"] for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "chat-template")
    volume = next(v for v in spec["volumes"] if v["name"] == "chat-template")
    assert volume["configMap"]["name"] == "tandem-chat-template" and mount["readOnly"]
    assert env["TANDEM_CHAT_TEMPLATE"] == str(Path(mount["mountPath"]) / "template.jinja")
    monkeypatch.setenv("TANDEM_CHAT_TEMPLATE", env["TANDEM_CHAT_TEMPLATE"])
    assert build_parser().parse_args(container["args"]).chat_template == env["TANDEM_CHAT_TEMPLATE"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize) to render")
def test_the_tls_component_gives_the_orchestrator_its_certificate_and_probes_it_over_https(tmp_path, monkeypatch):
    """components/tls: the tls Secret's files are where $TANDEM_TLS_CERT and
    $TANDEM_TLS_KEY point (--tls-cert, --tls-key), and the probes, which the
    kubelet cannot make over TLS with gRPC, are HTTPS GETs of /health on the
    HTTP API's port."""
    spec, container = _with_component(tmp_path, "tls")
    env = {e["name"]: e["value"] for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    volume = next(v for v in spec["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "tandem-tls" and mount["readOnly"]
    # `kubectl create secret tls` names its files tls.crt and tls.key
    assert env["TANDEM_TLS_CERT"] == f"{mount['mountPath']}/tls.crt"
    assert env["TANDEM_TLS_KEY"] == f"{mount['mountPath']}/tls.key"
    monkeypatch.setenv("TANDEM_TLS_CERT", env["TANDEM_TLS_CERT"])
    monkeypatch.setenv("TANDEM_TLS_KEY", env["TANDEM_TLS_KEY"])
    args = build_parser().parse_args(container["args"])
    assert (args.tls_cert, args.tls_key) == (env["TANDEM_TLS_CERT"], env["TANDEM_TLS_KEY"])
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert args.http_port == http
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": http, "scheme": "HTTPS"}, probe
        assert "grpc" not in container[probe]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize) to render")
def test_the_replicas_component_points_the_orchestrator_at_headless_services_of_several_pods(tmp_path):
    """components/replicas: the target's and the draft's Services are headless
    (their names resolve to every ready pod), each Deployment runs two pods, and
    the orchestrator's --target and --draft are those names as dns:/// replicas
    on the Services' gRPC ports."""
    from orchestrator.config import OrchestratorConfig, dns_target

    docs = _rendered(tmp_path, "replicas")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    args = build_parser().parse_args(deployments["tandem-orchestrator"]["spec"]["template"]["spec"]
                                     ["containers"][0]["args"])
    for role, address in (("target", args.target), ("draft", args.draft)):
        host, port = dns_target(address)
        service = services[host]
        assert service["spec"]["clusterIP"] == "None" and deployments[host]["spec"]["replicas"] == 2
        assert port in [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"], role
    assert services["tandem-orchestrator"]["spec"].get("clusterIP") != "None"
    OrchestratorConfig(draft_address=args.draft, target_address=args.target)  # accepted as replicas
