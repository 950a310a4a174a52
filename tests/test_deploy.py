"""Checks of deploy/: every file parses, the Kubernetes manifests match the Kubernetes API schemas,
the files agree with each other (ports, topics, images, metric names) and with docs/architecture.md.

No cluster, Docker or broker is needed. The Kubernetes schemas are the typed models of the official
Python client (`kubernetes` on PyPI, pydantic models with unknown fields forbidden and strict types).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_metrics import (
    ADAPTER_VALUES,
    DASHBOARD,
    DEPLOY_DIR,
    DESIGN_METRICS,
    EXTERNAL_METRICS,
    HISTOGRAM_SUFFIXES,
    alert_exprs,
    base_metric_name,
    dashboard_exprs,
    deploy_metric_names,
    deploy_metric_references,
    documented_metrics,
    external_metric_references,
    hpa_metric_names,
    promql_metric_names,
)

REPO = DEPLOY_DIR.parent
K8S = DEPLOY_DIR / "k8s"
COMPOSE = DEPLOY_DIR / "compose.yaml"
PROMETHEUS = DEPLOY_DIR / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY_DIR / "prometheus" / "alerts.yaml"
#: YAML files under deploy/k8s that are not Kubernetes objects.
K8S_NON_MANIFESTS = {K8S / "kustomization.yaml", ADAPTER_VALUES}
#: docs/architecture.md, "Topics", without the prefix (changelog topics are Faust's).
DESIGN_TOPICS = {
    "requests",
    "work.realtime",
    "work.interactive",
    "work.batch",
    "work.offline",
    "replies",
    "deadletter",
    "risk.events",
    "risk.decisions",
    "risk.rules",
    "risk.late",
}
WEB_PORT = 6066
GATEWAY_PORT = 8000


def _yaml_files() -> list[Path]:
    return sorted(p for ext in ("*.yaml", "*.yml") for p in DEPLOY_DIR.rglob(ext))


def _docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


@cache
def _k8s_objects() -> tuple[tuple[Path, dict[str, Any]], ...]:
    """Every Kubernetes object under deploy/k8s, parsed once (callers must not modify them)."""
    return tuple(
        (path, doc)
        for path in sorted(K8S.rglob("*.yaml"))
        if path not in K8S_NON_MANIFESTS
        for doc in _docs(path)
    )


def _k8s_object(kind: str, name: str) -> dict[str, Any]:
    for _, doc in _k8s_objects():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} under deploy/k8s")


def _container(deployment: str) -> dict[str, Any]:
    containers = _k8s_object("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _configmap() -> dict[str, str]:
    return _k8s_object("ConfigMap", "surge-config")["data"]


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))


def _created_topics(script: str) -> list[str]:
    return re.findall(r"^\s*create\s+([a-z][a-z.]*)\b", script, flags=re.MULTILINE)


# --- every file parses -------------------------------------------------------------------------


def test_every_yaml_and_json_file_parses() -> None:
    yaml_files = _yaml_files()
    json_files = sorted(DEPLOY_DIR.rglob("*.json"))
    assert len(yaml_files) >= 12 and json_files
    for path in yaml_files:
        docs = _docs(path)
        assert docs, f"{path} holds no YAML document"
        assert all(isinstance(d, dict) for d in docs), f"{path}: a document is not a mapping"
    for path in json_files:
        assert isinstance(json.loads(path.read_text(encoding="utf-8")), dict), path


# --- Kubernetes --------------------------------------------------------------------------------


def _model_class(api_version: str, kind: str) -> type[Any]:
    from kubernetes.client import models

    version = api_version.rsplit("/", 1)[-1]
    name = f"V{version[1:]}{kind}" if version.startswith("v") else ""
    cls = getattr(models, name, None)
    assert cls is not None, f"no Kubernetes model for apiVersion {api_version} kind {kind}"
    return cls


def test_k8s_manifests_validate_against_the_kubernetes_models() -> None:
    """Each object must deserialize into its typed model: unknown fields, missing required fields and
    wrong types (a number where Kubernetes wants a string, as in ConfigMap data or env values) fail."""
    objects = _k8s_objects()
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in objects}
    assert {
        ("Deployment", "surge-intake"),
        ("Deployment", "surge-inference"),
        ("Deployment", "surge-gateway"),
        ("Service", "surge-gateway"),
        ("ConfigMap", "surge-config"),
        ("HorizontalPodAutoscaler", "surge-inference"),
        ("PodDisruptionBudget", "surge-inference"),
    } <= kinds
    for path, doc in objects:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
        cls = _model_class(doc["apiVersion"], doc["kind"])
        obj = cls.model_validate(doc)
        assert obj.kind == doc["kind"] and obj.metadata.name, path


def test_k8s_validation_rejects_what_the_api_server_would() -> None:
    """The validation above is strict enough to matter: a typo, a missing name and an unquoted
    number all fail."""
    from pydantic import ValidationError

    deployment = _k8s_object("Deployment", "surge-inference")
    cls = _model_class(deployment["apiVersion"], "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for change in (
        {"imagePullPolicyy": "Always"},
        {"env": [{"name": "SURGE_PARTITIONS", "value": 8}]},
        {"resources": {"limits": {"nvidia.com/gpu": 1.5}}},
    ):
        broken = json.loads(json.dumps(deployment))
        broken["spec"]["template"]["spec"]["containers"][0] = {**container, **change}
        with pytest.raises(ValidationError):
            cls.model_validate(broken)
    nameless = json.loads(json.dumps(deployment))
    del nameless["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValidationError):
        cls.model_validate(nameless)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    listed = {K8S / r for r in kustomization["resources"]}
    assert all(p.is_file() for p in listed), sorted(str(p) for p in listed if not p.is_file())
    top_level = {p for p in K8S.glob("*.yaml") if p not in K8S_NON_MANIFESTS}
    assert listed == top_level
    assert kustomization["namespace"] == "surge"
    assert {i["name"] for i in kustomization["images"]} == {"surge"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_and_the_rendered_objects_validate() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(docs) == sum(1 for p, _ in _k8s_objects() if p.parent == K8S)
    for doc in docs:
        _model_class(doc["apiVersion"], doc["kind"]).model_validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "surge", doc["metadata"]["name"]


def test_workers_and_gateway_run_the_right_roles_on_the_configured_ports() -> None:
    config = _configmap()
    assert all(isinstance(v, str) for v in config.values())
    assert config["SURGE_WEB_PORT"] == str(WEB_PORT) and config["SURGE_GATEWAY_PORT"] == str(GATEWAY_PORT)
    assert config["SURGE_BROKER"].startswith("kafka://")
    assert config["SURGE_TOPIC_PREFIX"] == "surge."
    for name, role, port in (
        ("surge-intake", "intake", WEB_PORT),
        ("surge-inference", "inference", WEB_PORT),
        ("surge-risk", "risk", WEB_PORT),
    ):
        container = _container(name)
        assert container["args"] == ["worker", "--role", role]
        assert [p["containerPort"] for p in container["ports"]] == [port]
        annotations = _k8s_object("Deployment", name)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] == "/metrics"
        assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"
        assert {"name": "data", "mountPath": config["SURGE_DATA_DIR"]} in container["volumeMounts"]
    gateway = _container("surge-gateway")
    assert gateway["args"] == ["gateway"]
    assert [p["containerPort"] for p in gateway["ports"]] == [GATEWAY_PORT]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    service = _k8s_object("Service", "surge-gateway")
    assert (
        service["spec"]["selector"]
        == _k8s_object("Deployment", "surge-gateway")["spec"]["selector"]["matchLabels"]
    )


def test_inference_needs_one_gpu_and_cpu_roles_need_none() -> None:
    inference = _container("surge-inference")
    assert inference["image"].endswith(":cuda")
    assert inference["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for name in ("surge-intake", "surge-risk", "surge-gateway"):
        assert "nvidia.com/gpu" not in json.dumps(_container(name)["resources"])


def test_every_pod_runs_as_non_root() -> None:
    for _, doc in _k8s_objects():
        if doc["kind"] not in {"Deployment", "Job"}:
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_hpa_scales_inference_on_queue_per_worker_served_by_the_adapter() -> None:
    hpa = _k8s_object("HorizontalPodAutoscaler", "surge-inference")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "surge-inference",
    }
    (metric,) = [m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert metric["pods"]["metric"]["name"] == "requests_in_queue_per_worker"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "5"}
    assert (
        1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"] <= int(_configmap()["SURGE_PARTITIONS"])
    )
    adapter = yaml.safe_load(ADAPTER_VALUES.read_text(encoding="utf-8"))
    served = {rule["name"]["as"]: rule for rule in adapter["rules"]["custom"]}
    rule = served["requests_in_queue_per_worker"]
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert promql_metric_names(rule["seriesQuery"]) == {"requests_in_queue_per_worker"}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
    assert hpa_metric_names() <= set(served)


def test_pod_disruption_budgets_select_existing_deployments() -> None:
    deployments = {
        json.dumps(doc["spec"]["selector"]["matchLabels"], sort_keys=True)
        for _, doc in _k8s_objects()
        if doc["kind"] == "Deployment"
    }
    budgets = [doc for _, doc in _k8s_objects() if doc["kind"] == "PodDisruptionBudget"]
    assert len(budgets) == 4
    for pdb in budgets:
        assert json.dumps(pdb["spec"]["selector"]["matchLabels"], sort_keys=True) in deployments


def test_gpu_sharing_config_turns_on_mps_with_several_replicas() -> None:
    configmap = _k8s_object("ConfigMap", "nvidia-device-plugin-configs")
    (config_text,) = configmap["data"].values()
    config = yaml.safe_load(config_text)
    assert config["version"] == "v1"
    (resource,) = config["sharing"]["mps"]["resources"]
    assert resource["name"] == "nvidia.com/gpu" and resource["replicas"] >= 2
    assert (K8S / "gpu-sharing" / "README.md").is_file()


# --- topics -----------------------------------------------------------------------------------


def test_topic_scripts_create_the_design_topics() -> None:
    script = (DEPLOY_DIR / "kafka" / "create-topics.sh").read_text(encoding="utf-8")
    job = _k8s_object("Job", "surge-create-topics")["spec"]["template"]["spec"]["containers"][0]
    for created in (_created_topics(script), _created_topics(job["args"][0])):
        assert sorted(created) == sorted(DESIGN_TOPICS)
    assert job["image"] == "apache/kafka:4.1.1"
    # the request topic is stamped by the broker, and the topics clients write are stored
    # uncompressed (a compressed batch is then bounded decompressed), as ensure_topics creates them
    from pipeline.admin import topic_config
    from pipeline.settings import Settings

    settings = Settings.load()
    wanted = {
        "requests": topic_config(settings, "surge.requests", set()),
        "risk.events": topic_config(settings, "surge.risk.events", set()),
    }
    assert wanted == {
        "requests": {"message.timestamp.type": "LogAppendTime", "compression.type": "uncompressed"},
        "risk.events": {"compression.type": "uncompressed"},
    }
    for text in (script, job["args"][0]):
        for name, configs in wanted.items():
            (line,) = [ln for ln in text.splitlines() if ln.strip().startswith(f"create {name} ")]
            for key, value in configs.items():
                assert f"--config {key}={value}" in line, (name, key)


# --- compose ----------------------------------------------------------------------------------


def test_compose_runs_kafka_in_kraft_mode_and_every_role() -> None:
    services = _compose()["services"]
    assert {
        "kafka",
        "topics",
        "intake",
        "inference",
        "risk",
        "gateway",
        "prometheus",
        "grafana",
        "kafka-exporter",
    } <= set(services)
    kafka = services["kafka"]
    assert kafka["image"] == "apache/kafka:4.1.1"
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert (
        "CONTROLLER://" in env["KAFKA_LISTENERS"] and env["KAFKA_CONTROLLER_LISTENER_NAMES"] == "CONTROLLER"
    )
    assert services["intake"]["command"] == ["worker", "--role", "intake"]
    assert services["inference"]["command"] == ["worker", "--role", "inference"]
    assert services["risk"]["command"] == ["worker", "--role", "risk"]
    assert services["gateway"]["command"] == ["gateway"]
    assert services["gateway"]["ports"] == [f"{GATEWAY_PORT}:{GATEWAY_PORT}"]
    for name in ("intake", "inference", "risk", "gateway"):
        service_env = services[name]["environment"]
        assert service_env["SURGE_BROKER"] == "kafka://kafka:9092"
        assert service_env["SURGE_WEB_PORT"] == str(WEB_PORT)
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully"
    assert services["gateway"]["environment"]["HEALTHCHECK_URL"].endswith(f":{GATEWAY_PORT}/healthz")
    assert services["topics"]["entrypoint"][-1] == "/create-topics.sh"


#: a compose value that must be set by the operator: ``${NAME:?message}`` (no default)
_REQUIRED = re.compile(r"\$\{[A-Z_][A-Z0-9_]*:\?[^}]+\}")


def _listener_protocols(env: dict[str, Any]) -> dict[str, str]:
    """Kafka listener name → security protocol, from the listener map."""
    return dict(p.split(":", 1) for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))


def test_compose_publishes_kafka_only_behind_sasl_on_this_machine() -> None:
    kafka = _compose()["services"]["kafka"]
    env = kafka["environment"]
    listeners = {
        int(spec.rsplit(":", 1)[1]): spec.split("://", 1)[0] for spec in env["KAFKA_LISTENERS"].split(",")
    }
    protocols = _listener_protocols(env)
    assert kafka["ports"], "the host reaches Kafka through a published listener"
    for published in kafka["ports"]:
        host_ip, _, container = str(published).split(":")
        listener = listeners[int(container)]
        assert protocols[listener].startswith("SASL_"), f"{published}: {listener} is {protocols[listener]}"
        assert host_ip == "127.0.0.1", f"{published}: SASL_PLAINTEXT is published on this machine only"
        jaas = env[f"KAFKA_LISTENER_NAME_{listener}_PLAIN_SASL_JAAS_CONFIG"]
        assert "PlainLoginModule required" in jaas
        passwords = re.findall(r'user_[^=]+="([^"]*)"', jaas)
        assert passwords and all(_REQUIRED.fullmatch(p) for p in passwords), jaas
    assert "PLAIN" in env["KAFKA_SASL_ENABLED_MECHANISMS"].split(",")
    internal = [name for name, proto in protocols.items() if proto == "PLAINTEXT"]
    for published in kafka["ports"]:
        assert listeners[int(str(published).split(":")[-1])] not in internal


def test_compose_needs_its_secrets_and_has_no_default_password() -> None:
    services = _compose()["services"]
    # the gateway authenticates with the keys; the intake verifies signed records with them, the
    # inference workers sign replies back with them, the risk workers' escalation reader then wants
    # signed replies: one role without them and signed deployments lose every reply
    for name in ("gateway", "intake", "inference", "risk"):
        assert _REQUIRED.fullmatch(services[name]["environment"]["SURGE_API_KEYS"]), name
    grafana = services["grafana"]["environment"]
    assert _REQUIRED.fullmatch(grafana["GF_SECURITY_ADMIN_PASSWORD"])
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    text = COMPOSE.read_text(encoding="utf-8")
    assert not re.search(r":-\s*admin\b", text), "no admin/admin"
    for name in ("prometheus", "grafana"):  # no authentication of their own: this machine only
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"]), name
    assert "--web.enable-lifecycle" not in services["prometheus"]["command"]
    for name in ("intake", "inference"):
        assert "ports" not in services[name], f"{name}: the web port stays inside the compose network"
    example = (DEPLOY_DIR / ".env.example").read_text(encoding="utf-8")
    needed = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):\?", text))
    assert needed == {"SURGE_API_KEYS", "KAFKA_EXTERNAL_PASSWORD", "GRAFANA_ADMIN_PASSWORD"}
    for name in needed:
        assert re.search(rf"^{name}=$", example, flags=re.MULTILINE), f"{name}: in .env.example, empty"
    assert "deploy/.env" in (REPO / ".gitignore").read_text(encoding="utf-8").split()


def test_k8s_gateway_needs_its_keys_and_every_pod_can_take_kafka_credentials() -> None:
    for name in ("surge-intake", "surge-inference", "surge-risk", "surge-gateway"):
        container = _container(name)
        secrets = {e["secretRef"]["name"]: e["secretRef"] for e in container["envFrom"] if "secretRef" in e}
        assert secrets["surge-kafka-credentials"].get("optional") is True, name
        pod = _k8s_object("Deployment", name)["spec"]["template"]["spec"]
        (tls,) = [v for v in pod["volumes"] if v["name"] == "kafka-tls"]
        assert tls["secret"]["secretName"] == "surge-kafka-tls" and tls["secret"]["optional"] is True
        assert {"name": "kafka-tls", "mountPath": "/etc/surge/kafka-tls", "readOnly": True} in container[
            "volumeMounts"
        ]
        # no gateway without keys, and every worker has them (replies are signed back with them)
        assert secrets["surge-api-keys"].get("optional", False) is False, name
    assert _configmap()["SURGE_KAFKA_SECURITY_PROTOCOL"] in {"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"}
    job = _k8s_object("Job", "surge-create-topics")["spec"]["template"]["spec"]
    assert "--command-config" in job["containers"][0]["args"][0]
    assert job["volumes"][0]["secret"] == {"secretName": "surge-kafka-admin-client", "optional": True}


def test_every_surge_variable_deploy_sets_is_a_setting() -> None:
    from pipeline.settings import Settings

    fields = {f"SURGE_{name.upper()}" for name in Settings.model_fields}
    compose_only = {"SURGE_INTAKE_REPLICAS", "SURGE_INFERENCE_REPLICAS", "SURGE_RISK_REPLICAS"}
    texts = [p.read_text(encoding="utf-8") for p in [*_yaml_files(), DEPLOY_DIR / "README.md"]]
    used = set().union(*(re.findall(r"\bSURGE_[A-Z0-9_]*[A-Z0-9]\b", t) for t in texts))
    assert {"SURGE_KAFKA_SECURITY_PROTOCOL", "SURGE_KAFKA_SASL_USERNAME", "SURGE_KAFKA_SSL_CAFILE"} <= used
    assert used - compose_only <= fields, sorted(used - compose_only - fields)


def test_the_deploy_readme_says_how_to_reach_a_secured_cluster() -> None:
    text = (DEPLOY_DIR / "README.md").read_text(encoding="utf-8")
    section = text.split("## A secured Kafka cluster", 1)[1].split("\n## ", 1)[0]
    for needed in (
        "SASL_SSL",
        "SURGE_KAFKA_SASL_MECHANISM",
        "SURGE_KAFKA_SSL_CAFILE",
        "SURGE_KAFKA_SSL_CERTFILE",
        "SURGE_KAFKA_SSL_KEYFILE",
        "surge-kafka-tls",
        "--command-config",
    ):
        assert needed in section, needed


def test_compose_dollar_signs_are_interpolations_or_escaped() -> None:
    """Compose interpolates `$NAME` and `${NAME...}`; a literal `$` (a regex anchor) must be `$$`."""
    for compose_file in (COMPOSE, DEPLOY_DIR / "compose.gpu.yaml"):
        text = re.sub(r"\$\$", "", compose_file.read_text(encoding="utf-8"))
        stray = re.findall(r".{0,20}\$(?!\{[A-Z_][A-Z0-9_]*(?::?[-?][^}]*)?\}).{0,5}", text)
        assert not stray, f"{compose_file.name}: {stray}"


def test_compose_files_point_at_files_that_exist() -> None:
    for compose_file in (COMPOSE, DEPLOY_DIR / "compose.gpu.yaml"):
        for name, service in yaml.safe_load(compose_file.read_text(encoding="utf-8"))["services"].items():
            build = service.get("build")
            if build:
                context = (DEPLOY_DIR / build["context"]).resolve()
                assert context == REPO, name
                assert (context / build["dockerfile"]).is_file(), name
            for volume in service.get("volumes", []):
                source = volume.split(":", 1)[0]
                if source.startswith("."):
                    assert (DEPLOY_DIR / source).exists(), f"{name}: {source}"


def test_prometheus_scrapes_every_role_and_loads_the_alerts() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    assert config["rule_files"] == ["/etc/prometheus/alerts.yaml"]
    mounts = _compose()["services"]["prometheus"]["volumes"]
    assert "./prometheus/alerts.yaml:/etc/prometheus/alerts.yaml:ro" in mounts
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for role in ("intake", "inference", "risk"):
        (sd,) = jobs[f"surge-{role}"]["dns_sd_configs"]
        assert sd["names"] == [role] and sd["port"] == WEB_PORT
    assert jobs["surge-gateway"]["static_configs"][0]["targets"] == [f"gateway:{GATEWAY_PORT}"]
    assert jobs["kafka-exporter"]["static_configs"][0]["targets"] == ["kafka-exporter:9308"]


# --- Dockerfiles ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "base"), [("Dockerfile", "python:3.11-slim"), ("Dockerfile.cuda", "nvidia/cuda:")]
)
def test_dockerfiles_run_surge_as_non_root_with_a_healthcheck(name: str, base: str) -> None:
    text = (DEPLOY_DIR / "docker" / name).read_text(encoding="utf-8")
    assert re.search(rf"^ARG \w+_IMAGE={re.escape(base)}", text, flags=re.MULTILINE)
    assert re.search(r"^USER 10001:10001$", text, flags=re.MULTILINE)
    assert re.search(r"^HEALTHCHECK .*\n\s+CMD ", text, flags=re.MULTILINE)
    assert 'ENTRYPOINT ["surge"]' in text
    assert f"SURGE_WEB_PORT={WEB_PORT}" in text and f"SURGE_GATEWAY_PORT={GATEWAY_PORT}" in text
    ignore = (DEPLOY_DIR / "docker" / f"{name}.dockerignore").read_text(encoding="utf-8").split()
    assert "**/.venv" in ignore and "tests" in ignore


# --- alerts and dashboard ---------------------------------------------------------------------

_TEMPLATE_FUNCS = {"humanize", "humanize1024", "humanizeDuration", "humanizePercentage", "humanizeTimestamp"}


def _balanced(expr: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', "", expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def test_alert_rules_cover_the_failure_modes() -> None:
    rules = [
        rule
        for group in yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
        for rule in group["rules"]
    ]
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert _balanced(rule["expr"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]
        for text in rule["annotations"].values():
            for func in re.findall(r"\|\s*(\w+)\s*}}", text):
                assert func in _TEMPLATE_FUNCS, f"{rule['alert']}: unknown template function {func}"
    by_metric = [promql_metric_names(rule["expr"]) for rule in rules]
    for needed in (
        "surge_deadline_missed_total",
        "requests_queue_depth",
        "surge_deadletter_total",
        "kafka_consumergroup_lag",
        "surge_degradation_level",
    ):
        assert any(needed in names for names in by_metric), needed
    (degraded,) = [r for r in rules if "surge_degradation_level" in r["expr"]]
    assert re.search(r">=\s*3\b", degraded["expr"])


def test_dashboard_panels_are_wellformed_and_cover_the_pipeline() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]
    exprs = dashboard_exprs()
    assert all(_balanced(e) for e in exprs)
    used = set().union(*(promql_metric_names(e) for e in exprs))
    assert {
        "surge_request_latency_seconds_bucket",
        "requests_queue_depth",
        "surge_batch_size_sum",
        "surge_batch_fill_ratio_sum",
        "surge_cache_lookups_total",
        "surge_merged_total",
        "surge_degradation_level",
        "gpu_utilization",
        "surge_rate_limited_total",
        "surge_deadletter_total",
    } <= used
    assert any("histogram_quantile(0.99" in e and "priority" in e for e in exprs)
    assert any("histogram_quantile(0.5" in e and "priority" in e for e in exprs)
    datasource = yaml.safe_load(
        (DEPLOY_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text(
            encoding="utf-8"
        )
    )
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == datasource["datasources"][0]["uid"]


# --- metric names -----------------------------------------------------------------------------


def test_promql_metric_names_extracts_selectors_only() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, priority) (rate(a_seconds_bucket{priority="x"}[5m])))'
        " / clamp_min(sum without (job) (b_total offset 1h), 1e-9) > on (pod) group_left c"
        " and max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
        ' unless label_replace(d, "e", "$1", "f", "(.*)")'
    )
    assert promql_metric_names(expr) == {"a_seconds_bucket", "b_total", "c", "d"}


def test_every_metric_deploy_reads_is_a_design_metric() -> None:
    names = deploy_metric_names()
    assert names <= set(DESIGN_METRICS), sorted(names - set(DESIGN_METRICS))
    assert names == set(DESIGN_METRICS), f"never shown or alerted on: {sorted(set(DESIGN_METRICS) - names)}"
    assert external_metric_references() == set(EXTERNAL_METRICS)


def test_histogram_series_are_read_only_from_histograms() -> None:
    for series in deploy_metric_references():
        base = base_metric_name(series)
        if DESIGN_METRICS[base] == "histogram":
            assert series.endswith(HISTOGRAM_SUFFIXES), f"{series}: a histogram has no bare series"
        else:
            assert series == base, f"{series}: {base} is a {DESIGN_METRICS[base]}"
    for expr in [*dashboard_exprs(), *alert_exprs()]:
        for name in promql_metric_names(expr):
            if DESIGN_METRICS.get(name) == "counter":
                assert re.search(rf"(rate|increase)\(\s*{name}\b", expr), (
                    f"{name} read without rate(): {expr}"
                )


def test_every_metric_deploy_relies_on_is_documented_with_its_type() -> None:
    documented = documented_metrics()
    assert {name: documented.get(name) for name in DESIGN_METRICS} == DESIGN_METRICS
