"""The shipped scrape job and Grafana dashboard, run by the real Prometheus (Debian's package).

Real servers play the pods the manifests make: an InferenceService's primary and canary
revisions (two kserve-ascend processes) and the Triton Deployment's pod (real Triton). Prometheus
scrapes them through the shipped job's own relabel rules. This Prometheus build has no Kubernetes
discovery, so the job's `kubernetes_sd_configs` becomes `static_configs` holding the targets
Kubernetes discovery would make of each pod, with the same `__meta_kubernetes_*` labels, the pods
built from the manifests as KServe, Knative and Kubernetes build them. After a few seconds of load,
every query of the dashboard (its variables given concrete values) is evaluated through
Prometheus' HTTP API and must return data. The primary runs on the FAKE pyACL (NPU utilization)
and the FAKE DCMI library (NPU temperature, power and health).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import yaml

from conftest import (ROOT, build_fake_dcmi, copy_model, dashboard_row, fake_acl_env, fake_dcmi_env, free_port, load_fake_acl, start,
                      start_server, start_triton, stop_server, wait_for, write_dcmi_state)

MANIFESTS = ROOT / "manifests"
RUNTIME = MANIFESTS / "base" / "clusterservingruntime.yaml"
PRIMARY = MANIFESTS / "examples" / "inferenceservice-yolov8n.yaml"
CANARY = MANIFESTS / "examples" / "inferenceservice-yolov8n-canary.yaml"
TRITON = MANIFESTS / "triton" / "deployment.yaml"
SCRAPE_CONFIG = MANIFESTS / "monitoring" / "prometheus-scrape-config.yaml"
DASHBOARD = MANIFESTS / "monitoring" / "grafana-dashboard.json"

NAMESPACE = "models"
# `$__rate_interval`: Grafana's is at least four scrape intervals; this one spans the whole load.
RATE_INTERVAL = "1m"
LOAD_SECONDS = 3

# One execution of 100 ms at a time and one request waiting: a third at once is rejected (REJECTED).
BUSY_CONFIG = """name: "busy"
backend: "ascend"
max_batch_size: 1
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { default_queue_policy { max_queue_size: 1 } }
parameters { key: "sim_fixed_ms" value: { string_value: "100" } }
"""


def the(path: Path, kind: str) -> dict:
    (obj,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == kind]
    return obj


def flag(args: list[str], name: str) -> int:
    (value,) = [arg.partition("=")[2] for arg in args if arg.startswith(f"{name}=")]
    return int(value)


# --- The pods, as KServe, Knative and Kubernetes make them -----------------------------------


def kserve_pod_webhook(annotations: dict[str, str], cluster: dict[str, str]) -> dict[str, str]:
    """KServe's pod webhook on a pod's annotations, `cluster` being inferenceservice-config's
    metricsAggregator: InjectMetricsAggregator (kserve pkg/webhook/admission/pod/
    metrics_aggregate_injector.go, the same from 0.15.2 to 0.20 and main)."""
    pod = dict(annotations)
    aggregation = pod.setdefault("serving.kserve.io/enable-metric-aggregation", cluster["enableMetricAggregation"])
    scraping = pod.setdefault("serving.kserve.io/enable-prometheus-scraping", cluster["enablePrometheusScraping"])
    if scraping == "true":
        pod["prometheus.io/port"] = "9088" if aggregation == "true" else "9091"  # queue-proxy's, never the server's
        pod["prometheus.io/path"] = "/metrics"
    return pod


def isvc_pod_annotations(isvc: dict, cluster: dict[str, str]) -> dict[str, str]:
    """The annotations of an InferenceService's predictor pods, in either deployment mode: the
    runtime's spec.annotations, the service's, the predictor's, each overriding the one before
    (kserve pkg/controller/v1beta1/inferenceservice/components/predictor.go, buildObjectMeta),
    then KServe's pod webhook."""
    runtime = the(RUNTIME, "ClusterServingRuntime")["spec"].get("annotations", {})
    own = {**isvc["metadata"].get("annotations", {}), **isvc["spec"]["predictor"].get("annotations", {})}
    return kserve_pod_webhook({**runtime, **own}, cluster)


def knative_pod(isvc_path: Path, generation: int, cluster: dict[str, str]) -> dict:
    """A pod of revision `generation` of the InferenceService's predictor in Serverless mode.

    KServe's labels (buildObjectMeta) and the annotations go onto the Knative revision template
    (kserve reconcilers/knative/ksvc_reconciler.go), which Knative copies to the pod with its
    revision labels (knative/serving pkg/reconciler/revision/resources/meta.go, makeLabels).
    Containers: the runtime's, with the one port Knative declares for it (`user-port`, 8080
    unless the container names one), queue-proxy's four (resources/deploy.go, queue.go) and
    KServe's storage initializer (an init container).
    """
    isvc, runtime = the(isvc_path, "InferenceService"), the(RUNTIME, "ClusterServingRuntime")
    name = isvc["metadata"]["name"]
    service = f"{name}-predictor"
    revision = f"{service}-{generation:05d}"
    replica_set = f"{revision}-deployment-5d8f7c9b{generation}"
    (container,) = runtime["spec"]["containers"]
    user_port = (container.get("ports") or [{"containerPort": 8080}])[0]["containerPort"]
    return {
        "name": f"{replica_set}-x7k2q",
        "phase": "Running",
        "labels": {
            **isvc["metadata"].get("labels", {}),
            "serving.kserve.io/inferenceservice": name,
            "component": "predictor",
            "serving.knative.dev/service": service,
            "serving.knative.dev/configuration": service,
            "serving.knative.dev/configurationGeneration": str(generation),
            "serving.knative.dev/revision": revision,
            "serving.knative.dev/revisionUID": f"0c1e5f3a-0000-4000-8000-00000000000{generation}",
            "app": revision,
            "pod-template-hash": f"5d8f7c9b{generation}",
        },
        "annotations": isvc_pod_annotations(isvc, cluster),
        "controller": ("ReplicaSet", replica_set),
        "containers": [
            ("kserve-container", [("user-port", user_port)], False),
            ("queue-proxy", [("queue-port", 8012), ("http-queueadm", 8022), ("http-autometric", 9090), ("http-usermetric", 9091)], False),
            ("storage-initializer", [], True),
        ],
    }


def deployment_pod(path: Path) -> dict:
    """A pod of the Deployment: its template's labels and annotations, its containers' ports."""
    deployment = the(path, "Deployment")
    name, template = deployment["metadata"]["name"], deployment["spec"]["template"]
    spec = template["spec"]

    def ports(container: dict) -> list[tuple[str, int]]:
        return [(port.get("name", ""), port["containerPort"]) for port in container.get("ports", [])]

    return {
        "name": f"{name}-7c9d8f6b5-q4wz8",
        "phase": "Running",
        "labels": {**template["metadata"]["labels"], "pod-template-hash": "7c9d8f6b5"},
        "annotations": template["metadata"].get("annotations", {}),
        "controller": ("ReplicaSet", f"{name}-7c9d8f6b5"),
        "containers": [(c["name"], ports(c), False) for c in spec["containers"]]
        + [(c["name"], ports(c), True) for c in spec.get("initContainers", [])],
    }


def placed(pod: dict, ip: str, ports: dict[int, int]) -> dict:
    """The pod at `ip`, its ports (container ports, prometheus.io/port) mapped to the ports they have here."""
    def local(port) -> int:
        return ports.get(int(port), int(port))

    annotations = dict(pod["annotations"])
    if "prometheus.io/port" in annotations:
        assert int(annotations["prometheus.io/port"]) in ports, f"{pod['name']}: its server does not listen on {annotations['prometheus.io/port']}"
        annotations["prometheus.io/port"] = str(local(annotations["prometheus.io/port"]))
    containers = [(name, [(n, local(p)) for n, p in container_ports], init) for name, container_ports, init in pod["containers"]]
    return {**pod, "ip": ip, "annotations": annotations, "containers": containers}


def sanitized(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def discovered(pod: dict) -> list[dict[str, str]]:
    """The targets Prometheus' Kubernetes discovery (role: pod) makes of a pod: one per container
    port, one without a port per container that declares none, init containers included, each
    with the pod's labels (prometheus/prometheus discovery/kubernetes/pod.go, v2.42 buildPod)."""
    meta = {
        "__meta_kubernetes_namespace": NAMESPACE,
        "__meta_kubernetes_pod_name": pod["name"],
        "__meta_kubernetes_pod_ip": pod["ip"],
        "__meta_kubernetes_pod_phase": pod["phase"],
        "__meta_kubernetes_pod_ready": "true" if pod["phase"] == "Running" else "false",
        "__meta_kubernetes_pod_controller_kind": pod["controller"][0],
        "__meta_kubernetes_pod_controller_name": pod["controller"][1],
    }
    for prefix, values in (("label", pod["labels"]), ("annotation", pod["annotations"])):
        for key, value in values.items():
            meta[f"__meta_kubernetes_pod_{prefix}_{sanitized(key)}"] = value
            meta[f"__meta_kubernetes_pod_{prefix}present_{sanitized(key)}"] = "true"
    host = f"[{pod['ip']}]" if ":" in pod["ip"] else pod["ip"]
    targets = []
    for container, ports, init in pod["containers"]:
        common = {**meta, "__meta_kubernetes_pod_container_name": container, "__meta_kubernetes_pod_container_init": str(init).lower()}
        if not ports:
            targets.append({**common, "__address__": pod["ip"]})
        for port_name, port in ports:
            targets.append({**common, "__address__": f"{host}:{port}", "__meta_kubernetes_pod_container_port_name": port_name,
                            "__meta_kubernetes_pod_container_port_number": str(port), "__meta_kubernetes_pod_container_port_protocol": "TCP"})
    return targets


def static_job(pods: list[dict]) -> dict:
    """The shipped job, its Kubernetes discovery replaced by the targets it would discover."""
    (job,) = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    # Static targets with labels: `targets` holds __address__, which each target's labels set anyway.
    job["static_configs"] = [{"targets": [t["__address__"]], "labels": t} for pod in pods for t in discovered(pod)]
    return job


# Every combination of inferenceservice-config's metricsAggregator defaults.
CLUSTERS = [{"enableMetricAggregation": a, "enablePrometheusScraping": s} for a in ("false", "true") for s in ("false", "true")]


INFERENCE_SERVICES = sorted(path for path in MANIFESTS.rglob("*.yaml") if "\nkind: InferenceService\n" in path.read_text())


@pytest.mark.parametrize("isvc_path", INFERENCE_SERVICES, ids=lambda p: str(p.relative_to(MANIFESTS)))
@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda c: "aggregation={enableMetricAggregation},scraping={enablePrometheusScraping}".format(**c))
def test_kserve_leaves_the_metrics_port_on_the_pods_whatever_the_clusters_defaults(isvc_path, cluster):
    container = the(RUNTIME, "ClusterServingRuntime")["spec"]["containers"][0]
    annotations = isvc_pod_annotations(the(isvc_path, "InferenceService"), cluster)
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == flag(container["args"], "--metrics_port")
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_triton_pods_annotations_name_its_metrics_port():
    (container,) = the(TRITON, "Deployment")["spec"]["template"]["spec"]["containers"]
    annotations = deployment_pod(TRITON)["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == flag(container["args"], "--metrics-port")


# --- Real servers, real Prometheus ------------------------------------------------------------


def write_repository(directory: Path, version: int, om: bool) -> Path:
    """sim and busy at `version`, and (om) an .om model on the FAKE pyACL, which reports NPU utilization."""
    for name in ("sim", "busy"):
        model = copy_model("sim", directory, name)
        if version != 1:
            (model / "1").rename(model / str(version))
        if name == "busy":
            (model / "config.pbtxt").write_text(BUSY_CONFIG)
    if om:
        (directory / "detector" / "1").mkdir(parents=True)
        load_fake_acl().fake_write_om(directory / "detector" / "1" / "model.om", [("images", 0, [-1, 3, 8, 8])], dynamic_batch=[1, 2])
        (directory / "detector" / "config.pbtxt").write_text('name: "detector"\nbackend: "ascend"\nmax_batch_size: 2\n')
    return directory


class Prometheus:
    """Debian's Prometheus with `config`, once ready: its HTTP API."""

    def __init__(self, workdir: Path, config: dict):
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        checked = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=60, check=False)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        port = free_port()
        command = ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]
        self.server = start(command, workdir / "prometheus.log", port, name="prometheus", ready="/-/ready")

    def get(self, path: str, **params) -> dict:
        answer = requests.get(f"{self.server.url}/api/v1/{path}", params=params, timeout=10).json()
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("query", query=expr)["result"]

    def wait(self, condition, what: str):
        return wait_for(condition, f"Prometheus: {what}", timeout=60, server=self.server)


def load(servers: list, seconds: float) -> None:
    """`seconds` of requests to sim (batched) and busy (some rejected) of every server."""
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    end = time.monotonic() + seconds

    def client(url: str, model: str) -> set[int]:
        statuses = set()
        with requests.Session() as session:
            while time.monotonic() < end:
                status = session.post(f"{url}/v2/models/{model}/infer", json=body, timeout=30).status_code
                statuses.add(status)
                if status != 200:
                    time.sleep(0.01)
        return statuses

    with ThreadPoolExecutor(8 * len(servers)) as pool:
        calls = {(server.url, model): [pool.submit(client, server.url, model) for _ in range(count)]
                 for server in servers for model, count in (("sim", 4), ("busy", 4))}
    for (url, model), futures in calls.items():
        statuses = set().union(*(future.result() for future in futures))
        assert statuses == ({200, 503} if model == "busy" else {200}), (url, model, statuses)


def pods_played_by(primary, canary, triton) -> dict[str, dict]:
    """The pods of the manifests (and two the job must leave alone), placed at the servers playing them."""
    cluster = {"enableMetricAggregation": "true", "enablePrometheusScraping": "true"}  # the defaults that move ports
    metrics_port = flag(the(RUNTIME, "ClusterServingRuntime")["spec"]["containers"][0]["args"], "--metrics_port")
    triton_metrics_port = flag(the(TRITON, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"], "--metrics-port")
    return {
        "primary": placed(knative_pod(PRIMARY, 1, cluster), "127.0.0.1", {metrics_port: primary.metrics_port}),
        "canary": placed(knative_pod(CANARY, 2, cluster), "127.0.0.1", {metrics_port: canary.metrics_port}),
        # An IPv6 pod IP (IPv4-mapped, so that it reaches the loopback server): the job's IPv6 rule.
        "triton": placed(deployment_pod(TRITON), "::ffff:127.0.0.1", {triton_metrics_port: triton.metrics_port}),
        # Each at a live metrics port, so that a wrong rule would scrape it: a pod that does not
        # ask, and a finished pod that did (its IP may be another pod's by now).
        "unannotated": {"name": "other-app-0", "ip": "127.0.0.1", "phase": "Running", "labels": {"app": "other"},
                        "annotations": {}, "controller": ("StatefulSet", "other-app"),
                        "containers": [("app", [("metrics", primary.metrics_port)], False)]},
        "finished": {"name": "batch-job-x9k2d", "ip": "127.0.0.1", "phase": "Succeeded", "labels": {"job-name": "batch-job"},
                     "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(canary.metrics_port)},
                     "controller": ("Job", "batch-job"), "containers": [("job", [], False)]},
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Prometheus with the static version of the shipped job, the servers playing the pods, after the load."""
    work = tmp_path_factory.mktemp("prometheus")
    (work / "triton").mkdir()
    env = fake_acl_env()
    write_dcmi_state(work / "dcmi_state", [(0, 0, 0, 52, 750, 0)])  # one NPU: 52 °C, 75 W, normal
    on_npu = {**env, **fake_dcmi_env(build_fake_dcmi(work), work / "dcmi_state")}
    with ThreadPoolExecutor(3) as pool:
        starting = [pool.submit(start_server, write_repository(work / "primary", 1, om=True), work / "primary.log", env=on_npu),
                    pool.submit(start_server, write_repository(work / "canary", 2, om=False), work / "canary.log", env=env),
                    pool.submit(start_triton, write_repository(work / "triton_repo", 1, om=False), work / "triton")]
    servers = [future.result() for future in starting if future.exception() is None]
    prometheus = None
    try:
        if len(servers) < len(starting):
            raise next(future.exception() for future in starting if future.exception() is not None)
        pods = pods_played_by(*servers)
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [static_job(list(pods.values()))]}
        prometheus = Prometheus(work, config)
        # Discovery hands targets over every 5 s: wait until Prometheus scrapes the three pods.
        prometheus.wait(lambda: len(prometheus.query("up == 1")) >= 3, "three healthy targets")
        load(servers, LOAD_SECONDS)
        loaded = time.time()
        # Until every pod was scraped once more after the load, so that the final counts are in.
        prometheus.wait(lambda: float(prometheus.query("min(timestamp(up))")[0]["value"][1]) > loaded, "scrape after the load")
        yield {"prometheus": prometheus, "pods": pods}
    finally:
        if prometheus is not None:
            stop_server(prometheus.server)
        for server in servers:
            stop_server(server)


def series_labels(pod: dict) -> dict[str, str]:
    """The labels the job must give every series of a kept pod, from what the pod carries."""
    labels = {"job": "kserve-ascend", "namespace": NAMESPACE, "pod": pod["name"], "revision": pod["controller"][1]}
    if "serving.kserve.io/inferenceservice" in pod["labels"]:
        labels |= {"inferenceservice": pod["labels"]["serving.kserve.io/inferenceservice"],
                   "component": pod["labels"]["component"], "revision": pod["labels"]["serving.knative.dev/revision"]}
    return labels


def test_the_job_scrapes_each_annotated_running_pod_once_at_its_metrics_port(stack):
    pods, targets = stack["pods"], stack["prometheus"].get("targets")
    active = {t["labels"]["pod"]: t for t in targets["activeTargets"]}
    assert sorted(active) == sorted(pods[p]["name"] for p in ("primary", "canary", "triton"))  # one per pod, not per port
    for key in ("primary", "canary", "triton"):
        pod = pods[key]
        host = f"[{pod['ip']}]" if ":" in pod["ip"] else pod["ip"]
        target = active[pod["name"]]
        assert target["scrapeUrl"] == f"http://{host}:{pod['annotations']['prometheus.io/port']}{pod['annotations']['prometheus.io/path']}"
        assert target["health"] == "up", target["lastError"]
        assert series_labels(pod).items() <= target["labels"].items(), target["labels"]
    dropped = {t["discoveredLabels"]["__meta_kubernetes_pod_name"] for t in targets["droppedTargets"]}
    assert dropped == {pods["unannotated"]["name"], pods["finished"]["name"]}


def test_every_series_names_its_inference_service_and_revision(stack):
    prometheus, pods = stack["prometheus"], stack["pods"]
    found = {}
    for series in prometheus.query('nv_inference_request_success{model="sim"}'):
        labels = series["metric"]
        found[labels["pod"]] = {key: labels.get(key) for key in ("job", "namespace", "pod", "inferenceservice", "component", "revision", "version")}
    expected = {}
    for key, version in (("primary", "1"), ("canary", "2"), ("triton", "1")):
        pod = pods[key]
        expected[pod["name"]] = {"inferenceservice": None, "component": None, **series_labels(pod), "version": version}
    assert found == expected
    # Canary and primary: one InferenceService, two revisions.
    assert found[pods["primary"]["name"]]["inferenceservice"] == found[pods["canary"]["name"]]["inferenceservice"] == "yolov8n"
    assert found[pods["primary"]["name"]]["revision"] != found[pods["canary"]["name"]]["revision"]


# --- The dashboard's queries ------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_targets() -> list[tuple[str, str]]:
    """(panel title and refId, expr) of every query of every panel."""
    return [(f"{panel['title']} {target['refId']}", target["expr"])
            for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's interpolation: `$name` and `${name}`; an undefined variable fails."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m[1]], expr)


@pytest.fixture(scope="module")
def variables(stack) -> dict[str, list[str]]:
    """Each query variable's values, as Grafana's label_values(selector, label) asks Prometheus for
    them (/api/v1/label/<label>/values?match[]=<selector>), earlier variables substituted."""
    prometheus, values = stack["prometheus"], {}
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"]).groups()
        found = prometheus.get(f"label/{label}/values", **{"match[]": substitute(selector, regex_values(values))})
        assert found, f"variable {variable['name']} has no values"
        values[variable["name"]] = found
    return values


def regex_values(variables: dict[str, list[str]]) -> dict[str, str]:
    """Every value of each variable selected, as Grafana writes a multi-value into a regex matcher."""
    for value in (v for values in variables.values() for v in values):
        assert re.fullmatch(r"[\w.-]+", value), value  # nothing to escape
    return {name: "(" + "|".join(values) + ")" for name, values in variables.items()} | {"__rate_interval": RATE_INTERVAL}


def test_the_variables_offer_the_models_and_every_revision(stack, variables):
    pods = stack["pods"]
    assert {"sim", "busy", "detector"} <= set(variables["model"])
    assert set(variables["revision"]) == {series_labels(pods[p])["revision"] for p in ("primary", "canary", "triton")}


@pytest.mark.parametrize(("panel", "expr"), [pytest.param(panel, expr, id=panel) for panel, expr in panel_targets()])
def test_every_dashboard_query_returns_data(stack, variables, panel, expr):
    query = substitute(expr, regex_values(variables))
    assert stack["prometheus"].query(query), f"{panel}: no data for {query}"


def test_the_ab_row_puts_each_revision_side_by_side(stack, variables):
    pods = stack["pods"]
    primary, canary, triton = (series_labels(pods[p])["revision"] for p in ("primary", "canary", "triton"))
    ab = dashboard_row(dashboard()["panels"], "A/B: versions and revisions side by side")
    assert [panel["title"] for panel in ab] == ["Request rate per version", "P99 latency per version", "Failure rate per version"]
    # (revision, model version): the primary serves version 1, the canary version 2. The latency
    # histogram is kserve-ascend's (Triton has none); requests and failures come from both servers.
    both = {(primary, "1"), (canary, "2")}
    for panel, expected in zip(ab, (both | {(triton, "1")}, both, both | {(triton, "1")})):
        (target,) = panel["targets"]
        result = stack["prometheus"].query(substitute(target["expr"], regex_values(variables) | {"model": "sim"}))
        assert {(series["metric"]["revision"], series["metric"]["version"]) for series in result} == expected, panel["title"]
    failures = stack["prometheus"].query(substitute(ab[2]["targets"][0]["expr"], regex_values(variables) | {"model": "busy"}))
    assert {s["metric"]["revision"] for s in failures if float(s["value"][1]) > 0} >= {primary, canary}  # rejected bursts


def test_the_npu_row_shows_each_pods_npus_as_the_driver_reads_them(stack):
    """The primary's one NPU through the FAKE DCMI (52 °C, 750 in 0.1 W, health 0); the others have no DCMI."""
    primary = stack["pods"]["primary"]["name"]
    found = {}
    for panel in dashboard_row(dashboard()["panels"], "NPU temperature, power and health"):
        (target,) = panel["targets"]
        found[panel["title"]] = {(s["metric"]["pod"], s["metric"]["device"]): float(s["value"][1])
                                 for s in stack["prometheus"].query(target["expr"])}
    assert found == {"NPU temperature": {(primary, "0"): 52}, "NPU power": {(primary, "0"): 75}, "NPU health": {(primary, "0"): 0}}


# --- Queries other manifests hand to Prometheus -----------------------------------------------


def prometheus_queries(node) -> list[str]:
    """Every `query` beside a `serverAddress` (KEDA's prometheus trigger, KServe's external metric)."""
    if isinstance(node, dict):
        own = [node["query"]] if "query" in node and "serverAddress" in node else []
        return own + [q for value in node.values() for q in prometheus_queries(value)]
    if isinstance(node, list):
        return [q for value in node for q in prometheus_queries(value)]
    return []


AUTOSCALING_QUERIES = sorted({(str(path.relative_to(MANIFESTS)), query) for path in MANIFESTS.rglob("*.yaml")
                              for doc in yaml.safe_load_all(path.read_text()) for query in prometheus_queries(doc)})


@pytest.mark.parametrize(("path", "query"), AUTOSCALING_QUERIES, ids=[path for path, _ in AUTOSCALING_QUERIES])
def test_every_autoscaling_query_finds_the_inference_services_series(stack, path, query):
    result = stack["prometheus"].query(query)
    assert result and all(float(series["value"][1]) > 0 for series in result), f"{path}: {query} -> {result}"
