"""manifests/ and docker/, checked against what consumes them.

- KServe's objects (InferenceService, ServingRuntime, ClusterServingRuntime) field by field
  against the kserve SDK's models and the Kubernetes models they nest: an unknown or
  misspelled field fails. (`ApiClient.deserialize` cannot do it: it fails on these objects and
  drops unknown fields silently.)
- Kubernetes' own objects against the API schema of a pinned Kubernetes version
  (kubernetes-validate, strict: unknown fields fail too).
- The runtime's and the Triton Deployment's args by the real argument parsers, then the real
  servers started with those args (ports and paths substituted) and asked every probe path.
- The Grafana dashboard's queries against the metrics the running server exposes, and the
  scrape job against the annotations the pods carry.
- The Dockerfiles: every COPY source exists in the build context; the entrypoint is the real CLI.
"""

from __future__ import annotations

import copy
import fnmatch
import importlib.util
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kserve_ascend.server  # noqa: F401  (first: it makes kserve importable beside tritonclient)
import kubernetes.client.models
import kubernetes_validate
import pydantic
import pytest
import requests
import yaml
from google.protobuf import text_format
from kserve import models as kserve_models
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import model_config_pb2

from conftest import FAKE_ACL, REPOSITORY, ROOT, Server, copy_model, free_port, load_fake_acl, stop_server, wait_until

MANIFESTS = ROOT / "manifests"
DOCKER = ROOT / "docker"
KUBERNETES_VERSION = "1.31"  # the oldest Kubernetes the manifests are meant for

RUNTIME = MANIFESTS / "base" / "clusterservingruntime.yaml"
NAMESPACED_RUNTIME = MANIFESTS / "base" / "servingruntime.yaml"
TRITON = MANIFESTS / "triton"
DASHBOARD = MANIFESTS / "monitoring" / "grafana-dashboard.json"
SCRAPE_CONFIG = MANIFESTS / "monitoring" / "prometheus-scrape-config.yaml"  # Prometheus' format, not Kubernetes'
OBJECT_FILES = sorted(p for p in MANIFESTS.rglob("*.yaml") if p.name != "kustomization.yaml" and p != SCRAPE_CONFIG)
KUSTOMIZATIONS = sorted(p.parent for p in MANIFESTS.rglob("kustomization.yaml"))

KSERVE_KINDS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): kserve_models.V1beta1InferenceService,
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): kserve_models.V1alpha1ServingRuntime,
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): kserve_models.V1alpha1ClusterServingRuntime,
}


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def the(path: Path, kind: str) -> dict:
    """The one object of `kind` in the file."""
    (obj,) = [doc for doc in documents(path) if doc["kind"] == kind]
    return obj


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- Validation --------------------------------------------------------------------------


class InvalidManifest(Exception):
    pass


_PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool, "object": object, "datetime": str}


def _model_class(name: str) -> type:
    cls = getattr(kserve_models, name, None) or getattr(kubernetes.client.models, name, None)
    if cls is None:
        raise AssertionError(f"no model named {name} in kserve.models or kubernetes.client.models")
    return cls


def build(openapi_type: str, value, path: str):
    """`value` (parsed YAML) as an instance of the SDK type named `openapi_type`.

    Walks the models' `openapi_types` and `attribute_map` (kserve's and Kubernetes' both have
    them): a key that no attribute maps to is an error, and so is a value of the wrong type.
    Then the model itself refuses what is missing: kserve's setters a required field,
    Kubernetes' pydantic models a required field or a value of the wrong type.
    """
    if match := re.fullmatch(r"[Ll]ist\[(.+)\]", openapi_type):
        if not isinstance(value, list):
            raise InvalidManifest(f"{path}: expected a list, got {value!r}")
        return [build(match[1], item, f"{path}[{i}]") for i, item in enumerate(value)]
    if match := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", openapi_type):
        if not isinstance(value, dict):
            raise InvalidManifest(f"{path}: expected a mapping, got {value!r}")
        return {key: build(match[1] or match[2], item, f"{path}.{key}") for key, item in value.items()}
    if openapi_type in _PRIMITIVES:
        if not isinstance(value, _PRIMITIVES[openapi_type]) or (isinstance(value, bool) and openapi_type != "bool"):
            raise InvalidManifest(f"{path}: expected {openapi_type}, got {value!r}")
        return value
    cls = _model_class(openapi_type)
    if not isinstance(value, dict):
        raise InvalidManifest(f"{path}: expected a {cls.__name__} mapping, got {value!r}")
    # Wire names only: pydantic alone would also take Python names (`liveness_probe`), which the API refuses.
    attributes = {key: attribute for attribute, key in cls.attribute_map.items()}
    unknown = sorted(set(value) - set(attributes))
    if unknown:
        raise InvalidManifest(f"{path}: unknown field(s) {unknown} of {cls.__name__} (known: {sorted(attributes)})")
    fields = {attributes[key]: build(cls.openapi_types[attributes[key]], item, f"{path}.{key}") for key, item in value.items()}
    try:
        return cls.model_validate(value) if issubclass(cls, pydantic.BaseModel) else cls(**fields)
    except ValueError as error:  # pydantic's ValidationError is one too
        raise InvalidManifest(f"{path}: {error}") from None


def validate(obj: dict) -> None:
    """A Kubernetes object, by the kserve SDK's models or by Kubernetes' API schema."""
    model = KSERVE_KINDS.get((obj.get("apiVersion"), obj.get("kind")))
    if model is None:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        return
    build(model.__name__, obj, obj["kind"])
    # Their containers are Kubernetes' core type: the API schema checks them once more (formats, ranges).
    for container in obj["spec"].get("containers", []):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": {"containers": [container]}}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", OBJECT_FILES, ids=relative)
def test_every_manifest_is_a_valid_object(path):
    objects = documents(path)
    assert objects, f"{relative(path)} holds no object"
    for obj in objects:
        validate(obj)


def _rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


MISSPELLINGS = {
    # An InferenceService field (a kserve model).
    "isvc minReplica": (MANIFESTS / "examples" / "inferenceservice-yolov8n.yaml",
                        lambda o: _rename(o["spec"]["predictor"], "minReplicas", "minReplica"), "minReplica"),
    "isvc storageURI": (MANIFESTS / "examples" / "inferenceservice-yolov8n.yaml",
                        lambda o: _rename(o["spec"]["predictor"]["model"], "storageUri", "storageURI"), "storageURI"),
    # A Kubernetes field nested in a kserve object (V1Container in the runtime).
    "runtime readinesProbe": (RUNTIME, lambda o: _rename(o["spec"]["containers"][0], "readinessProbe", "readinesProbe"),
                              "readinesProbe"),
    # Its Python name, which the SDK's model would take but the API refuses.
    "runtime liveness_probe": (RUNTIME, lambda o: _rename(o["spec"]["containers"][0], "livenessProbe", "liveness_probe"),
                               "liveness_probe"),
    # A wrong type in a kserve model.
    "runtime autoSelect string": (RUNTIME, lambda o: o["spec"]["supportedModelFormats"][1].update(autoSelect="yes"),
                                  "autoSelect"),
    # A core object (API schema).
    "deployment httpGet.paht": (TRITON / "deployment.yaml",
                                lambda o: _rename(o["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"],
                                                  "path", "paht"), "paht"),
}


@pytest.mark.parametrize("case", MISSPELLINGS)
def test_the_validation_catches_a_misspelled_field(case):
    path, mutate, field = MISSPELLINGS[case]
    (obj,) = documents(path)
    validate(copy.deepcopy(obj))  # the manifest as written passes
    mutate(obj)
    with pytest.raises((InvalidManifest, kubernetes_validate.ValidationError)) as error:
        validate(obj)
    assert field in str(error.value)


def test_the_namespaced_runtime_is_the_cluster_runtime():
    cluster, namespaced = the(RUNTIME, "ClusterServingRuntime"), the(NAMESPACED_RUNTIME, "ServingRuntime")
    assert namespaced["metadata"] == cluster["metadata"]
    assert namespaced["spec"] == cluster["spec"]


@pytest.fixture(scope="module")
def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl (its built-in kustomize) is not installed")
    return path


def kustomize(kubectl: str, directory: Path) -> list[dict]:
    rendered = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc is not None]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=relative)
def test_every_kustomization_renders_valid_objects(kubectl, directory):
    objects = kustomize(kubectl, directory)
    assert objects
    for obj in objects:
        validate(obj)


def test_the_ascend310_overlay_asks_for_an_ascend310_npu(kubectl):
    (runtime,) = kustomize(kubectl, MANIFESTS / "overlays" / "ascend310")
    limits = runtime["spec"]["containers"][0]["resources"]["limits"]
    assert limits["huawei.com/Ascend310"] == "1"
    assert "huawei.com/Ascend910" not in limits
    assert the(RUNTIME, "ClusterServingRuntime")["spec"]["containers"][0]["resources"]["limits"]["huawei.com/Ascend910"] == "1"


def test_the_monitoring_kustomization_ships_the_dashboard_and_the_scrape_job(kubectl):
    objects = {obj["kind"]: obj for obj in kustomize(kubectl, MANIFESTS / "monitoring")}
    dashboard = objects["ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's dashboard sidecar loads
    assert json.loads(dashboard["data"][DASHBOARD.name]) == json.loads(DASHBOARD.read_text())
    assert "prometheus-scrape-config.yaml" in objects["Secret"]["data"]


# --- The KServe runtime, run with its own args --------------------------------------------


def runtime_container() -> dict:
    (container,) = the(RUNTIME, "ClusterServingRuntime")["spec"]["containers"]
    return container


def flag_values(args: list[str]) -> dict[str, str]:
    """`--flag=value` and `--flag value` pairs of a command line."""
    values, i = {}, 0
    while i < len(args):
        if args[i].startswith("--") and "=" in args[i]:
            flag, _, value = args[i].partition("=")
            values[flag] = value
        elif args[i].startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            values[args[i]] = args[i + 1]
            i += 1
        i += 1
    return values


def substitute(args: list[str], values: dict[str, str]) -> list[str]:
    """The command line with these flags' values replaced (each flag must be there)."""
    assert set(values) <= set(flag_values(args)), f"{sorted(values)} not all in {args}"
    out, i = [], 0
    while i < len(args):
        flag = args[i].partition("=")[0]
        if flag in values and "=" in args[i]:
            out.append(f"{flag}={values[flag]}")
        elif flag in values:
            out += [flag, values[flag]]
            i += 1
        else:
            out.append(args[i])
        i += 1
    return out


def test_the_runtime_args_are_the_servers_flags():
    from kserve_ascend.server.app import build_parser

    runtime = the(RUNTIME, "ClusterServingRuntime")
    container = runtime_container()
    args = build_parser().parse_args(container["args"])  # an unknown flag exits: SystemExit fails the test
    assert args.model_dir == "/mnt/models"  # where KServe's storage initializer puts storageUri
    assert args.http_port == 8080  # the port KServe and Knative route to when the runtime declares none
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == args.http_port
    assert int(runtime["spec"]["annotations"]["prometheus.kserve.io/port"]) == args.metrics_port
    # Knative's queue-proxy shares the pod's network and listens on these.
    assert not {args.http_port, args.grpc_port, args.metrics_port} & {8012, 8013, 8022, 9090, 9091}


@pytest.mark.parametrize("path", sorted((MANIFESTS / "examples").glob("inferenceservice-*.yaml")), ids=relative)
def test_the_examples_are_served_by_the_runtime(path):
    runtime = the(RUNTIME, "ClusterServingRuntime")
    model = the(path, "InferenceService")["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]


@pytest.fixture(scope="module")
def runtime_ports(tmp_path_factory) -> dict[int, int]:
    """`kserve-ascend` (the image's entrypoint) run with the runtime's args, its ports and
    model_dir substituted; yields each port of the manifest -> the port it has here.

    The repository holds yolov8n and an `.om` model on the FAKE pyACL (tests/fake_acl), so
    every metric the dashboard reads, NPU utilization included, is exposed.
    """
    repository = tmp_path_factory.mktemp("mnt_models")
    copy_model("yolov8n", repository)
    (repository / "detector" / "1").mkdir(parents=True)
    load_fake_acl().fake_write_om(repository / "detector" / "1" / "model.om", [("images", 0, [-1, 3, 8, 8])], dynamic_batch=[1, 2])
    (repository / "detector" / "config.pbtxt").write_text('name: "detector"\nbackend: "ascend"\nmax_batch_size: 2\n')

    args = runtime_container()["args"]
    given = flag_values(args)
    ports = {flag: free_port() for flag in ("--http_port", "--grpc_port", "--metrics_port")}
    command = [str(Path(sys.executable).with_name("kserve-ascend")),
               *substitute(args, {"--model_dir": str(repository), **{f: str(p) for f, p in ports.items()}})]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(FAKE_ACL), os.environ.get("PYTHONPATH")]))}
    log = repository.parent / "runtime.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(process, ports["--http_port"], ports["--grpc_port"], log, ports["--metrics_port"])
    port_of = {int(given[flag]): port for flag, port in ports.items()}
    ready = runtime_container()["readinessProbe"]["httpGet"]
    url = f"http://127.0.0.1:{port_of[ready['port']]}{ready['path']}"
    wait_until(server, lambda: requests.get(url, timeout=1).status_code == 200, timeout=120)
    yield port_of
    stop_server(server)


@pytest.mark.parametrize("probe", ["livenessProbe", "readinessProbe"])
def test_the_running_runtime_answers_its_probes(runtime_ports, probe):
    get = runtime_container()[probe]["httpGet"]
    response = requests.get(f"http://127.0.0.1:{runtime_ports[get['port']]}{get['path']}", timeout=5)
    assert response.status_code == 200, response.text


def scrape(port: int, path: str) -> dict[str, set[str]]:
    """Every sample name of the exposition at that port and path, with the label names it carries."""
    response = requests.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    assert response.status_code == 200, response.text
    samples: dict[str, set[str]] = {}
    # Line by line, so untyped: given `# TYPE x counter`, the parser renames x's samples x_total
    # (OpenMetrics), while Prometheus stores them as exposed.
    lines = [line for line in response.text.splitlines() if line and not line.startswith("#")]
    for family in (family for line in lines for family in text_string_to_metric_families(line)):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def runtime_metrics(port_of: dict[int, int]) -> dict[str, set[str]]:
    annotations = the(RUNTIME, "ClusterServingRuntime")["spec"]["annotations"]
    port = port_of[int(annotations["prometheus.kserve.io/port"])]
    return scrape(port, annotations["prometheus.kserve.io/path"])


def test_the_running_runtime_serves_metrics_where_its_annotations_say(runtime_ports):
    assert "nv_inference_request_success" in runtime_metrics(runtime_ports)


# --- The dashboard and the scrape job ----------------------------------------------------

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def selectors(expr: str) -> list[tuple[str, list[str]]]:
    """(metric name, label names it matches on) of every vector selector of a PromQL expression."""
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations, [$__rate_interval]
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists name no metric
    found = []
    for match in re.finditer(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?", expr):
        name, labels = match[1], match[2] or ""
        if name in _PROMQL_WORDS or expr[match.end():].lstrip().startswith("("):
            continue  # a keyword or a function
        found.append((name, re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", labels)))
    return found


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"])
            queries.append(f"{query[1]}{{{query[2]}!=\"\"}}")  # the same metric and label, as a selector
    return queries


def test_the_dashboard_has_qps_p99_batch_sizes_queue_depth_and_npu_utilization():
    queries = " ".join(dashboard_queries())
    assert "rate(nv_inference_request_success" in queries  # QPS
    assert re.search(r"histogram_quantile\(0\.99, sum by \(le[^)]*\) \(rate\(inference_latency_seconds_bucket", queries)
    for metric in ("batch_size_distribution_bucket", "inference_queue_depth", "npu_utilization_percent"):
        assert metric in queries


def test_the_dashboard_reads_only_metrics_and_labels_the_server_exposes(runtime_ports):
    exposed = runtime_metrics(runtime_ports)
    for query in dashboard_queries():
        found = selectors(query)
        assert found, query
        for name, labels in found:
            assert name in exposed, f"{name} (in {query}) is not exposed; exposed: {sorted(exposed)}"
            assert set(labels) <= exposed[name], f"{name} has no label {set(labels) - exposed[name]} (in {query})"


def test_promql_selectors_are_found_without_functions_keywords_or_grouping_labels():
    expr = 'histogram_quantile(0.99, sum by (le, model) (rate(a_bucket{model=~"$m", version!="1"}[5m]))) / on(model) b'
    assert selectors(expr) == [("a_bucket", ["model", "version"]), ("b", [])]


def relabel(target: dict[str, str], rules: list[dict]) -> dict[str, str] | None:
    """Prometheus' relabelling of one discovered target by the `keep` and `replace` actions (None: dropped)."""
    labels = dict(target)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)  # Prometheus anchors the regex at both ends
        action = rule.get("action", "replace")
        assert action in ("keep", "replace"), f"relabel action {action} is not simulated here"
        if action == "keep" and not match:
            return None
        if action == "replace" and match:
            labels[rule["target_label"]] = match.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rule.get("replacement", "$1")))
    return labels


def discovered(pod_ip: str, annotations: dict[str, str], ports: list[int]) -> list[dict[str, str]]:
    """The targets Prometheus' pod discovery yields for a pod: one per declared container port."""
    meta = {"__meta_kubernetes_namespace": "ns", "__meta_kubernetes_pod_name": "pod-0"}
    meta |= {f"__meta_kubernetes_pod_annotation_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v for k, v in annotations.items()}
    return [{"__address__": f"{pod_ip}:{port}", **meta} for port in ports]


def scraped(pod_ip: str, annotations: dict[str, str], ports: list[int]) -> set[tuple[str, str]]:
    (job,) = yaml.safe_load(SCRAPE_CONFIG.read_text())
    kept = [relabel(t, job["relabel_configs"]) for t in discovered(pod_ip, annotations, ports)]
    return {(t["__address__"], t.get("__metrics_path__", "/metrics")) for t in kept if t is not None}


def test_the_scrape_job_finds_the_triton_pods_metrics():
    template = the(TRITON / "deployment.yaml", "Deployment")["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = [port["containerPort"] for port in container["ports"]]
    annotations = template["metadata"]["annotations"]
    assert scraped("10.0.0.7", annotations, ports) == {(f"10.0.0.7:{annotations['prometheus.io/port']}", "/metrics")}
    assert annotations["prometheus.io/port"] == "8002"
    assert scraped("10.0.0.7", {}, ports) == set()  # pods that do not ask are left alone


def test_the_scrape_job_finds_an_inference_services_metrics():
    # With serving.kserve.io/enable-prometheus-scraping, KServe annotates the pod with the runtime's port and path.
    runtime = the(RUNTIME, "ClusterServingRuntime")["spec"]["annotations"]
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": runtime["prometheus.kserve.io/port"],
                   "prometheus.io/path": runtime["prometheus.kserve.io/path"]}
    isvc = the(MANIFESTS / "examples" / "inferenceservice-yolov8n.yaml", "InferenceService")
    assert isvc["metadata"]["annotations"]["serving.kserve.io/enable-prometheus-scraping"] == "true"
    # Knative declares the serving port 8080 on the user container, the queue-proxy its own.
    assert scraped("10.0.0.8", annotations, [8080, 8012, 9090, 9091]) == {("10.0.0.8:8082", "/metrics")}


# --- The Triton variant ---------------------------------------------------------------------


def triton_container() -> dict:
    (container,) = the(TRITON / "deployment.yaml", "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def mounted_configs() -> dict[str, str]:
    """Each config.pbtxt the Deployment mounts from the ConfigMap, by the model directory it lands in."""
    data = the(TRITON / "configmap.yaml", "ConfigMap")["data"]
    configs = {}
    for mount in triton_container()["volumeMounts"]:
        if mount.get("subPath") in data:
            directory = posixpath.dirname(mount["mountPath"])
            assert mount["mountPath"] == f"{directory}/config.pbtxt"
            configs[posixpath.basename(directory)] = data[mount["subPath"]]
    return configs


def test_the_triton_configmap_holds_model_configs_for_the_directories_they_mount_in():
    configs = mounted_configs()
    assert configs
    for directory, text in configs.items():
        config = text_format.Parse(text, model_config_pb2.ModelConfig())  # strict: an unknown field fails
        assert config.name == directory  # Triton requires it
        assert config.backend == "ascend"


def test_the_triton_service_routes_to_the_deployments_ports():
    deployment = the(TRITON / "deployment.yaml", "Deployment")
    service = the(TRITON / "service.yaml", "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    named = {port["name"]: port["containerPort"] for port in triton_container()["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in named


def run_triton_module():
    spec = importlib.util.spec_from_file_location("run_triton", ROOT / "tools" / "run_triton.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def triton_args(repository: Path, backends: Path, ports: dict[str, int]) -> list[str]:
    """The Deployment's args with the repository and ports substituted, and a private backend directory."""
    args = substitute(triton_container()["args"], {"--model-repository": str(repository), **{f: str(p) for f, p in ports.items()}})
    return [f"--backend-directory={backends}", *args]


def test_the_triton_args_are_tritonservers_flags(tmp_path):
    launcher = run_triton_module()
    ports = {"--http-port": 8000, "--grpc-port": 8001, "--metrics-port": 8002}
    argv, env = launcher.command(launcher.parse_args(triton_args(tmp_path / "models", tmp_path / "backends", ports)))
    usage = subprocess.run([argv[0], "--help"], capture_output=True, text=True, env=env, timeout=60)
    known = set(re.findall(r"--[a-z][a-z0-9-]*", usage.stdout + usage.stderr))
    assert "--model-repository" in known, usage.stdout + usage.stderr
    flags = [arg.partition("=")[0] for arg in argv[1:]]
    assert "--exit-timeout-secs" in flags  # the ones given after `--` reach tritonserver
    assert set(flags) <= known, set(flags) - known


@pytest.fixture(scope="module")
def triton_ports(tmp_path_factory) -> dict[int | str, int]:
    """Triton as the Deployment runs it: the image's entrypoint (tools/run_triton.py) with its args,
    on a repository laid out as in the pod (the storage initializer's model file, the ConfigMap's
    config); yields each port of the manifest (number or name) -> the port it has here."""
    workdir = tmp_path_factory.mktemp("triton_deployment")
    for directory, text in mounted_configs().items():
        (workdir / "models" / directory / "1").mkdir(parents=True)
        shutil.copy(REPOSITORY / directory / "1" / "model.onnx", workdir / "models" / directory / "1")
        (workdir / "models" / directory / "config.pbtxt").write_text(text)
    given = flag_values(triton_container()["args"])
    ports = {flag: free_port() for flag in ("--http-port", "--grpc-port", "--metrics-port")}
    command = [sys.executable, str(ROOT / "tools" / "run_triton.py"), *triton_args(workdir / "models", workdir / "backends", ports)]
    log = workdir / "triton.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, ports["--http-port"], ports["--grpc-port"], log, ports["--metrics-port"])
    named = {port["name"]: port["containerPort"] for port in triton_container()["ports"]}
    port_of: dict[int | str, int] = {int(given[flag]): port for flag, port in ports.items()}
    port_of |= {name: port_of[number] for name, number in named.items()}
    ready = triton_container()["readinessProbe"]["httpGet"]
    url = f"http://127.0.0.1:{port_of[ready['port']]}{ready['path']}"
    wait_until(server, lambda: requests.get(url, timeout=1).status_code == 200, timeout=180)
    yield port_of
    stop_server(server)


@pytest.mark.parametrize("probe", ["startupProbe", "livenessProbe", "readinessProbe"])
def test_the_running_triton_answers_its_probes(triton_ports, probe):
    get = triton_container()[probe]["httpGet"]
    response = requests.get(f"http://127.0.0.1:{triton_ports[get['port']]}{get['path']}", timeout=5)
    assert response.status_code == 200, response.text


def test_the_running_triton_serves_metrics_where_its_annotations_say(triton_ports):
    annotations = the(TRITON / "deployment.yaml", "Deployment")["spec"]["template"]["metadata"]["annotations"]
    metrics = scrape(triton_ports[int(annotations["prometheus.io/port"])], annotations["prometheus.io/path"])
    assert "nv_inference_request_success" in metrics


# --- The Dockerfiles ------------------------------------------------------------------------

DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = (line.strip() for line in text.splitlines())
    return [(line.partition(" ")[0].upper(), line.partition(" ")[2].strip()) for line in lines if line and not line.startswith("#")]


def copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """(sources in the build context, absolute destination) of every COPY from the context."""
    found, workdir = [], "/"
    for instruction, arguments in instructions(dockerfile):
        if instruction == "WORKDIR":
            workdir = posixpath.join(workdir, arguments)
        elif instruction == "COPY":
            words = shlex.split(arguments)
            if any(word.startswith("--from") for word in words):
                continue
            *sources, destination = [word for word in words if not word.startswith("--")]
            found.append((sources, posixpath.normpath(posixpath.join(workdir, destination))))
    return found


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore leaves `path` out of the build context: the last pattern that
    matches the path or one of its parents decides; `!` patterns put it back."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    result = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        if any(fnmatch.fnmatchcase(candidate, pattern) for candidate in candidates):
            result = not keep
    return result


def ignore_patterns(dockerfile: Path) -> list[str]:
    """The Dockerfile's own ignore file (BuildKit reads <Dockerfile>.dockerignore beside it)."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.exists(), f"{relative(ignore)}: without it the whole work tree (.venv included) is sent to the builder"
    lines = (line.strip() for line in ignore.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_dockerignore_matching():
    patterns = ["*", "!kserve_ascend", "!tools/run_triton.py", "**/__pycache__"]
    assert ignored(".venv/bin/python", patterns)
    assert not ignored("kserve_ascend/server/app.py", patterns)
    assert not ignored("tools/run_triton.py", patterns)
    assert ignored("tools/make_simple.py", patterns)
    assert ignored("kserve_ascend/__pycache__/x.pyc", patterns)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=relative)
def test_every_copied_path_is_in_the_build_context(dockerfile):
    patterns = ignore_patterns(dockerfile)
    sources = [source for sources, _ in copies(dockerfile) for source in sources]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"{relative(dockerfile)} copies {source}, which does not exist"
        assert not ignored(source.rstrip("/"), patterns), f"{relative(dockerfile)} copies {source}, which its ignore file leaves out"


def entrypoint(dockerfile: Path) -> list[str]:
    (arguments,) = [arguments for instruction, arguments in instructions(dockerfile) if instruction == "ENTRYPOINT"]
    return json.loads(arguments)  # the exec form: signals reach the server, not a shell


def built_as(dockerfile: Path) -> str:
    """The image name its documented build command tags it with."""
    (tag,) = re.findall(rf"docker build -f {re.escape(relative(dockerfile))} -t (\S+) \.", dockerfile.read_text())
    return tag


def test_the_kserve_image_installs_the_package_and_runs_its_cli():
    dockerfile = DOCKER / "kserve.Dockerfile"
    sources = [source for sources, _ in copies(dockerfile) for source in sources]
    assert {"pyproject.toml", "README.md", "kserve_ascend"} <= set(sources)  # what `pip install .` builds from
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (command,) = entrypoint(dockerfile)
    assert scripts[command] == "kserve_ascend.__main__:main"
    # The runtime passes only flags (no command): they reach that entrypoint.
    container = runtime_container()
    assert "command" not in container
    assert container["image"] == built_as(dockerfile)


def test_the_kserve_image_builds_on_a_pinned_cann_image_with_python_3_11():
    dockerfile = DOCKER / "kserve.Dockerfile"
    (base,) = re.findall(r"^ARG CANN_IMAGE=(\S+)$", dockerfile.read_text(), re.M)
    # Ascend's CANN images are tagged <cann>-<chip>-<os>-<python>; pyproject.toml asks for Python 3.11.
    assert re.fullmatch(r"quay\.io/ascend/cann:\d+\.\d+\.\w+-\w+-ubuntu\d+\.\d+-py3\.11", base), base
    assert ("FROM", "${CANN_IMAGE}") in instructions(dockerfile)


def test_the_triton_image_adds_the_triton_launcher_to_the_kserve_image():
    dockerfile = DOCKER / "triton.Dockerfile"
    (base,) = re.findall(r"^ARG KSERVE_ASCEND_IMAGE=(\S+)$", dockerfile.read_text(), re.M)
    assert base == built_as(DOCKER / "kserve.Dockerfile")
    assert ("FROM", "${KSERVE_ASCEND_IMAGE}") in instructions(dockerfile)
    interpreter, script = entrypoint(dockerfile)
    assert interpreter == "python"
    destinations = {destination: sources for sources, destination in copies(dockerfile)}
    assert destinations[script] == ["tools/run_triton.py"]
    # run_triton.py takes the backend from beside it: <root>/triton_backend/ascend/model.py.
    backend = posixpath.join(posixpath.dirname(posixpath.dirname(script)), "triton_backend/ascend/model.py")
    assert destinations[backend] == ["triton_backend/ascend/model.py"]
    container = triton_container()
    assert "command" not in container
    assert container["image"] == built_as(dockerfile)
