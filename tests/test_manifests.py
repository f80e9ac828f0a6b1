"""manifests/ and docker/, checked against what consumes them.

- Custom resources (KServe's, KEDA's, Istio's, Seldon's) against their projects' real CRD schemas
  (tests/crds, tests/crd_schema.py): a field the API server would prune fails. KServe's objects
  also field by field against the kserve SDK's models and the Kubernetes models they nest.
  (`ApiClient.deserialize` cannot do it: it fails on these objects and drops unknown fields silently.)
- Kubernetes' own objects against the API schema of a pinned Kubernetes version
  (kubernetes-validate, strict: unknown fields fail too).
- The runtime's and the Triton Deployment's args by the real argument parsers, then the real
  servers started with those args (ports and paths substituted) and asked every probe path.
- The Grafana dashboard's panels and layout. (Its queries and the scrape job run in the real
  Prometheus against the real servers: test_prometheus.py.)
- Every container of every manifest as Pod Security `restricted` admits it, with one handler per
  probe and hook; the project's images run as their image's user, every pod with the host's
  HwHiAiUser group, set in one place; the chip overlays change exactly the NPU resource, the node
  selector (by the label scheme chosen in one place) and the image; no rollout of one-NPU pods
  needs a spare NPU; every server's preStop delay and shutdown timeout fit in its pod's grace
  period; Knative-only features pin the deployment mode. (Downloads by KServe's storage
  initializer: test_storage.py.)
- The Dockerfiles: every COPY source exists in the build context and is readable by the image's
  user, who is created before USER names it; the entrypoint is the real CLI.
"""

from __future__ import annotations

import copy
import fnmatch
import importlib.metadata
import importlib.util
import json
import math
import socket
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import kserve_ascend.server  # noqa: F401  (first: it makes kserve importable beside tritonclient)
from kserve_ascend.server.observability import npu_telemetry
import jsonschema
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

import crd_schema
from conftest import REPOSITORY, ROOT, Server, copy_model, dashboard_row, fake_acl_env, free_port, load_fake_acl, stop_server, wait_for

MANIFESTS = ROOT / "manifests"
DOCKER = ROOT / "docker"
KUBERNETES_VERSION = "1.31"  # the oldest Kubernetes the manifests are meant for

RUNTIME = MANIFESTS / "base" / "clusterservingruntime.yaml"
NAMESPACED_RUNTIME = MANIFESTS / "base" / "servingruntime.yaml"
TRITON = MANIFESTS / "triton"
DASHBOARD = MANIFESTS / "monitoring" / "grafana-dashboard.json"
SCRAPE_CONFIG = MANIFESTS / "monitoring" / "prometheus-scrape-config.yaml"  # Prometheus' format, not Kubernetes'
OBJECT_FILES = sorted(p for p in MANIFESTS.rglob("*.yaml") if p.name != "kustomization.yaml" and p != SCRAPE_CONFIG)
#: Directories kubectl applies (-k), and kustomize components, which they include (manifests/components).
KUSTOMIZATIONS, COMPONENTS = (
    sorted(p.parent for p in MANIFESTS.rglob("kustomization.yaml") if yaml.safe_load(p.read_text()).get("kind", "Kustomization") == kind)
    for kind in ("Kustomization", "Component"))

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


_PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool, "object": object, "datetime": str,
               # A resource.Quantity (an integer or a string), which the kserve SDK names but does not ship.
               "V1beta1MetricQuantity": (int, str)}


#: Kubernetes types the kserve SDK names by their OpenAPI name but does not ship: Kubernetes' own model.
_ALIASES = {"K8sIoApiAppsV1DeploymentStrategy": "V1DeploymentStrategy"}


def _model_class(name: str) -> type:
    name = _ALIASES.get(name, name)
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


#: The handlers of a probe and of a lifecycle hook (Kubernetes pkg/apis/core/validation/validation.go,
#: handlerFromProbe and handlerFromLifecycle).
PROBE_HANDLERS = ("exec", "httpGet", "tcpSocket", "grpc")
LIFECYCLE_HANDLERS = ("exec", "httpGet", "tcpSocket", "sleep")


def handler_errors(pod: dict) -> list[str]:
    """What the API server refuses in a pod spec's probes and lifecycle hooks and a JSON Schema cannot
    say: each names exactly one handler (validation.go, validateHandler: "may not specify more than 1
    handler type", "must specify a handler type")."""
    errors = []
    for container in pod.get("initContainers", []) + pod.get("containers", []):
        actions = [(probe, PROBE_HANDLERS) for probe in ("livenessProbe", "readinessProbe", "startupProbe")]
        actions += [(f"lifecycle.{hook}", LIFECYCLE_HANDLERS) for hook in ("postStart", "preStop")]
        for where, handlers in actions:
            action = container
            for key in where.split("."):
                action = (action or {}).get(key)
            named = [handler for handler in handlers if (action or {}).get(handler) is not None]
            if action is not None and len(named) != 1:
                errors.append(f"{container['name']}.{where}: exactly one of {', '.join(handlers)}, not {named}")
    return errors


def validate(obj: dict) -> None:
    """A Kubernetes object: a custom resource by its CRD's schema (KServe's also by the kserve SDK's
    models), any other by Kubernetes' API schema; every pod spec in it by the handler rule."""
    for where, pod in pod_specs(obj):
        assert handler_errors(pod) == [], where
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key not in crd_schema.kinds():
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # no CRD of ours: a built-in kind, or it fails
        return
    crd_schema.validate(obj)
    model = KSERVE_KINDS.get(key)
    if model is None:
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
    with pytest.raises((InvalidManifest, kubernetes_validate.ValidationError, jsonschema.ValidationError)) as error:
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


# Per chip overlay: the extended resource Ascend's device plugin advertises the NPUs as, the values
# of the node label the overlay's pods are pinned with under each labelling scheme, and the image tag
# docker/kserve.Dockerfile is built as for that chip's CANN image (the base's is 910B).
# Resources as Ascend's MindCluster documentation lists them in "Preparation of Job YAML Files"
# (hiascend.com/document/detail/zh/mindcluster/600/clustersched/usage/schedulingug/mxdlug_scheduling_049.html:
# Atlas 800I A2 huawei.com/Ascend910, Atlas 300I huawei.com/Ascend310, Atlas inference series
# huawei.com/Ascend310P). node.kubernetes.io/npu.chip.name: the Name of `npu-smi info`, set by
# MindCluster's device plugin ("K8s原生对象说明", .../mindcluster/60rc3/clustersched/reference/api/dlug_api_039.html;
# Ascend/mind-cluster component/ascend-device-plugin/pkg/server/manager.go, updateChipNameToNode).
# accelerator: the label the older Ascend/ascend-device-plugin's DaemonSets select their nodes by
# (build/ascendplugin-910.yaml, -310.yaml, -310P.yaml, nodeSelector), and MindCluster's plugin sets
# from 26.1.0 (component/ascend-common/api/default_name.go, Accelerator910Label ...).
CHIP_LABELS = {"npu-chip-name": "node.kubernetes.io/npu.chip.name", "accelerator": "accelerator"}
CHIPS = {
    "ascend910": ("huawei.com/Ascend910", {"npu-chip-name": r"910(A|ProA|ProB|PremiumA)", "accelerator": "huawei-Ascend910"},
                  "kserve-ascend:0.1.0-910"),
    "ascend910b": ("huawei.com/Ascend910", {"npu-chip-name": r"910B[1-4]", "accelerator": "huawei-Ascend910"}, "kserve-ascend:0.1.0"),
    "ascend310": ("huawei.com/Ascend310", {"npu-chip-name": r"310", "accelerator": "huawei-Ascend310"}, "kserve-ascend:0.1.0-310"),
    "ascend310p": ("huawei.com/Ascend310P", {"npu-chip-name": r"310P[1-4]", "accelerator": "huawei-Ascend310P"},
                   "kserve-ascend:0.1.0-310p"),
}
#: Every kustomization pinned to a chip, with its chip: the overlays and the MindIE-style vNPU one.
CHIP_PINNED = {**{MANIFESTS / "overlays" / overlay: overlay for overlay in CHIPS}, MANIFESTS / "mindie" / "vnpu": "ascend310p"}
CHIP_LABEL_COMPONENT = MANIFESTS / "components" / "chip-label"


def with_chip_label(tmp_path: Path, scheme: str) -> Path:
    """A copy of manifests/ with the labelling scheme `scheme` chosen where a user chooses it."""
    copy = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, copy)
    kustomization = copy / CHIP_LABEL_COMPONENT.relative_to(MANIFESTS) / "kustomization.yaml"
    component = yaml.safe_load(kustomization.read_text())
    assert component["components"] == ["npu-chip-name"]  # the default: MindCluster's device plugin
    kustomization.write_text(yaml.safe_dump({**component, "components": [scheme]}))
    return copy


def leaves(node, path: tuple = ()) -> dict[tuple, object]:
    """Every scalar of a parsed object by its path."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in leaves(value, (*path, key)).items()}
    if isinstance(node, list):
        return {k: v for i, value in enumerate(node) for k, v in leaves(value, (*path, i)).items()}
    return {path: node}


def test_there_is_an_overlay_per_chip_and_a_component_per_chip_label():
    assert {path.name for path in (MANIFESTS / "overlays").iterdir()} == set(CHIPS)
    assert {path.parent.name for path in CHIP_LABEL_COMPONENT.glob("*/kustomization.yaml")} == set(CHIP_LABELS)


@pytest.mark.parametrize("scheme", sorted(CHIP_LABELS))
@pytest.mark.parametrize("overlay", sorted(CHIPS))
def test_a_chip_overlay_changes_exactly_the_npu_resource_the_node_selector_and_the_image(kubectl, tmp_path, overlay, scheme):
    resource, chip, image = CHIPS[overlay]
    manifests = with_chip_label(tmp_path, scheme)
    (base,) = kustomize(kubectl, manifests / "base")
    (runtime,) = kustomize(kubectl, manifests / "overlays" / overlay)
    (container,) = runtime["spec"]["containers"]
    assert container["resources"]["limits"][resource] == "1"
    assert [name for name in container["resources"]["limits"] if name.startswith("huawei.com/")] == [resource]
    label = CHIP_LABELS[scheme]
    assert list(runtime["spec"]["nodeSelector"]) == [label]
    assert re.fullmatch(chip[scheme], runtime["spec"]["nodeSelector"][label]), runtime["spec"]["nodeSelector"]
    assert container["image"] == image
    before, after = leaves(base), leaves(runtime)
    changed = {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}
    limits = ("spec", "containers", 0, "resources", "limits")
    assert changed <= {(*limits, "huawei.com/Ascend910"), (*limits, resource), ("spec", "nodeSelector", label),
                       ("spec", "containers", 0, "image")}, changed
    assert ("spec", "nodeSelector", label) in changed


@pytest.mark.parametrize("scheme", sorted(CHIP_LABELS))
def test_the_chip_label_is_chosen_in_one_place_for_every_chip_pinned_kustomization(kubectl, tmp_path, scheme):
    manifests = with_chip_label(tmp_path, scheme)
    pinned = {}
    for directory in KUSTOMIZATIONS:
        for obj in kustomize(kubectl, manifests / directory.relative_to(MANIFESTS)):
            for where, pod in pod_specs(obj):
                if "nodeSelector" in pod:
                    pinned[directory] = pod["nodeSelector"]
    assert set(pinned) == set(CHIP_PINNED)  # no pod is pinned to a chip elsewhere
    for directory, selector in pinned.items():
        value = CHIPS[CHIP_PINNED[directory]][1][scheme]
        assert list(selector) == [CHIP_LABELS[scheme]] and re.fullmatch(value, selector[CHIP_LABELS[scheme]]), (relative(directory), selector)


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
    from kserve_ascend.server.cli import build_parser

    runtime = the(RUNTIME, "ClusterServingRuntime")
    container = runtime_container()
    args = build_parser().parse_args(container["args"])  # an unknown flag exits: SystemExit fails the test
    assert args.model_dir == "/mnt/models"  # where KServe's storage initializer puts storageUri
    assert args.http_port == 8080  # the port KServe and Knative route to when the runtime declares none
    for probe in ("livenessProbe", "readinessProbe"):
        assert probe_action(container[probe])["port"] == args.http_port
    # The port Prometheus scrapes (the runtime's pod annotations; test_prometheus.py runs the scrape).
    assert int(runtime["spec"]["annotations"]["prometheus.io/port"]) == args.metrics_port
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
    env = {**os.environ, **fake_acl_env()}
    log = repository.parent / "runtime.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(process, ports["--http_port"], ports["--grpc_port"], log, ports["--metrics_port"])
    port_of = {int(given[flag]): port for flag, port in ports.items()}
    ready = runtime_container()["readinessProbe"]["httpGet"]
    url = f"http://127.0.0.1:{port_of[ready['port']]}{ready['path']}"
    wait_for(lambda: requests.get(url, timeout=1).status_code == 200, "the runtime ready", timeout=120, server=server)
    yield port_of
    stop_server(server)


def probe_action(probe: dict) -> dict:
    """The probe's httpGet or tcpSocket action (the kinds these manifests use)."""
    (action,) = [probe[kind] for kind in ("httpGet", "tcpSocket") if kind in probe]
    return action


def passes(probe: dict, port: int) -> bool:
    """Whether the kubelet would count `probe` a success against 127.0.0.1:`port`: an HTTP answer
    from 200 to 399, or a TCP connection accepted."""
    if "tcpSocket" in probe:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    response = requests.get(f"http://127.0.0.1:{port}{probe['httpGet']['path']}", timeout=5)
    return 200 <= response.status_code < 400


@pytest.mark.parametrize("probe", ["livenessProbe", "readinessProbe"])
def test_the_running_runtime_answers_its_probes(runtime_ports, probe):
    probe = runtime_container()[probe]
    assert passes(probe, runtime_ports[probe_action(probe)["port"]])


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
    return scrape(port_of[int(annotations["prometheus.io/port"])], annotations["prometheus.io/path"])


def test_the_running_runtime_serves_metrics_where_its_annotations_say(runtime_ports):
    assert "nv_inference_request_success" in runtime_metrics(runtime_ports)


# --- The dashboard (its queries run in the real Prometheus: test_prometheus.py) ----------

# Grafana's own variables, which a dashboard uses without defining them.
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_the_dashboard_has_qps_p99_batch_sizes_queue_depth_and_npu_utilization():
    queries = " ".join(dashboard_queries())
    assert "rate(nv_inference_request_success" in queries  # QPS
    assert re.search(r"histogram_quantile\(0\.99, sum by \(le[^)]*\) \(rate\(inference_latency_seconds_bucket", queries)
    for metric in ("batch_size_distribution_bucket", "inference_queue_depth", "npu_utilization_percent"):
        assert metric in queries


def test_the_dashboards_ab_row_sets_request_rate_p99_and_failure_rate_per_revision_and_version_side_by_side():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    (row,) = [i for i, panel in enumerate(panels) if panel["type"] == "row" and panel["title"].startswith("A/B")]
    ab = panels[row + 1:row + 4]
    assert [panel["title"] for panel in ab] == ["Request rate per version", "P99 latency per version", "Failure rate per version"]
    assert len({panel["gridPos"]["y"] for panel in ab}) == 1  # one line
    for panel, metric in zip(ab, ("nv_inference_request_success", "inference_latency_seconds_bucket", "nv_inference_request_failure")):
        (target,) = panel["targets"]
        assert metric in target["expr"]
        assert re.search(r"sum by \((le, )?revision, model, version\)", target["expr"]), target["expr"]
        assert 'revision=~"$revision"' in target["expr"]
    assert "histogram_quantile(0.99," in ab[1]["targets"][0]["expr"]
    assert "revision" in {variable["name"] for variable in dashboard["templating"]["list"]}


def test_the_dashboards_device_rows_read_memory_loading_and_npu_telemetry():
    panels = json.loads(DASHBOARD.read_text())["panels"]

    def row(title: str) -> dict[str, list[str]]:
        """The row's panels: title -> their queries."""
        return {panel["title"]: [target["expr"] for target in panel["targets"]] for panel in dashboard_row(panels, title)}

    memory = row("Device memory and model loading")
    assert [re.search(r"\(ascend_device_memory_(\w+)_bytes\)", expr)[1] for expr in memory["Device memory"]] == ["used", "total", "budget"]
    assert all(expr.startswith("max by (pod, device)") for expr in memory["Device memory"])
    (per_version,) = memory["Memory per model version"]
    assert per_version.startswith("sum by (pod, model, version) (ascend_model_memory_bytes{")
    (loads,) = memory["Model loads by reason"]
    assert "sum by (model, reason) (increase(ascend_model_loads{" in loads
    (evictions,) = memory["Model evictions"]
    assert "sum by (model) (increase(ascend_model_evictions{" in evictions
    waits = memory["Wait for a model to load P99 / P50"]
    assert [expr.split(",")[0] for expr in waits] == ["histogram_quantile(0.99", "histogram_quantile(0.50"]
    assert all("sum by (le, model) (rate(ascend_model_load_wait_seconds_bucket{" in expr for expr in waits)
    npu = row("NPU temperature, power and health")
    assert npu == {title: [f"max by (pod, device) ({metric})"] for title, metric in (
        ("NPU temperature", "ascend_npu_temperature_celsius"), ("NPU power", "ascend_npu_power_watts"), ("NPU health", "ascend_npu_health"))}
    assert {metric for (expr,) in npu.values() for metric in re.findall(r"\((ascend_npu_\w+)\)", expr)} == set(npu_telemetry.METRICS)


def test_the_dashboard_is_laid_out_and_wired_as_grafana_reads_it():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]  # Grafana's 24 columns
        for cell in ((x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])):
            assert cell not in cells, f"{panel['title']} overlaps {cells[cell]}"
            cells[cell] = panel["title"]
    defined = {variable["name"] for variable in dashboard["templating"]["list"]} | GRAFANA_VARIABLES
    for panel in (panel for panel in panels if panel["type"] != "row"):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            used = set(re.findall(r"\$\{?(\w+)", target["expr"]))
            assert used <= defined, f"{panel['title']}: undefined {used - defined}"


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
    wait_for(lambda: requests.get(url, timeout=1).status_code == 200, "the server ready", timeout=180, server=server)
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


# --- Pod security, rollouts and deployment modes -------------------------------------------


def pod_specs(obj: dict) -> list[tuple[str, dict]]:
    """(where, mapping) of every pod spec in an object, at any depth: each mapping that holds a
    `containers` list (a Deployment's spec.template.spec, a ServingRuntime's spec, ...)."""
    found = []

    def walk(node, where: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("containers"), list):
                found.append((where, node))
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{where}[{i}]")

    walk(obj, obj["kind"])
    return found


def effective_security(pod: dict, container: dict) -> dict:
    """A container's securityContext with the pod's fields it inherits (Kubernetes: the container's win)."""
    inherited = {key: value for key, value in pod.get("securityContext", {}).items()
                 if key in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile")}
    return inherited | container.get("securityContext", {})


def restricted_violations(pod: dict) -> list[str]:
    """What Pod Security's `restricted` profile refuses in a pod spec, container by container
    (kubernetes.io/docs/concepts/security/pod-security-standards: non-root, no privilege
    escalation, all capabilities dropped but NET_BIND_SERVICE, a RuntimeDefault or Localhost
    seccomp profile; baseline's no privileged containers)."""
    problems = []
    for container in pod.get("initContainers", []) + pod["containers"]:
        context, name = effective_security(pod, container), container["name"]
        if context.get("runAsNonRoot") is not True or context.get("runAsUser") == 0:
            problems.append(f"{name}: not runAsNonRoot")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if context.get("privileged"):
            problems.append(f"{name}: privileged")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: capabilities not dropped")
        if context.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: no RuntimeDefault seccomp profile")
    return problems


POD_FILES = [path for path in OBJECT_FILES if any(pod_specs(obj) for obj in documents(path))]


def test_the_pod_manifests_include_the_runtimes_and_the_triton_deployment():
    assert {RUNTIME, NAMESPACED_RUNTIME, TRITON / "deployment.yaml"} <= set(POD_FILES)


@pytest.mark.parametrize("path", POD_FILES, ids=relative)
def test_every_container_is_allowed_by_pod_security_restricted(path):
    for obj in documents(path):
        for where, pod in pod_specs(obj):
            assert restricted_violations(pod) == [], f"{relative(path)}: {where}"


REMOVALS = {
    "the runtime's whole securityContext": (RUNTIME, lambda o: o["spec"]["containers"][0].pop("securityContext")),
    "the runtime's runAsNonRoot": (RUNTIME, lambda o: o["spec"]["containers"][0]["securityContext"].pop("runAsNonRoot")),
    "the runtime's allowPrivilegeEscalation": (RUNTIME, lambda o: o["spec"]["containers"][0]["securityContext"].pop("allowPrivilegeEscalation")),
    "the runtime's capabilities": (RUNTIME, lambda o: o["spec"]["containers"][0]["securityContext"].pop("capabilities")),
    "the runtime's seccompProfile": (RUNTIME, lambda o: o["spec"]["containers"][0]["securityContext"].pop("seccompProfile")),
    # The Triton containers inherit runAsNonRoot and the seccomp profile from the pod.
    "the Triton pod's securityContext": (TRITON / "deployment.yaml", lambda o: o["spec"]["template"]["spec"].pop("securityContext")),
    "the initializer's securityContext": (TRITON / "deployment.yaml", lambda o: o["spec"]["template"]["spec"]["initContainers"][0].pop("securityContext")),
}


@pytest.mark.parametrize("case", REMOVALS)
def test_the_check_refuses_a_container_without_each_setting(case):
    path, remove = REMOVALS[case]
    (obj,) = documents(path)
    remove(obj)
    assert any(restricted_violations(pod) for _, pod in pod_specs(obj))


def expanded(dockerfile: Path) -> list[tuple[str, str]]:
    """instructions() with each ${NAME} replaced by its ARG's default (a build without --build-arg)."""
    defaults, steps = {}, []
    for instruction, arguments in instructions(dockerfile):
        arguments = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m[1], m[0]), arguments)
        if instruction == "ARG" and "=" in arguments:
            name, _, value = arguments.partition("=")
            defaults[name] = value
        steps.append((instruction, arguments))
    return steps


def image_user(dockerfile: Path) -> tuple[int, int]:
    """(uid, gid) of the image's last USER: numeric, so that the kubelet can check runAsNonRoot
    without the image's /etc/passwd."""
    (*_, user) = [arguments for instruction, arguments in expanded(dockerfile) if instruction == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit(), user
    return int(uid), int(gid)


def test_the_project_images_run_as_their_images_user_in_every_manifest():
    users = {built_as(dockerfile): image_user(dockerfile) for dockerfile in DOCKERFILES}
    checked = 0
    for path in POD_FILES:
        for obj in documents(path):
            for where, pod in pod_specs(obj):
                for container in pod.get("initContainers", []) + pod["containers"]:
                    image = container["image"].partition(":")[0]
                    tags = [tag for tag in users if tag.partition(":")[0] == image]
                    if tags:
                        context = effective_security(pod, container)
                        assert (context.get("runAsUser"), context.get("runAsGroup")) == users[tags[0]], f"{relative(path)}: {where}"
                        checked += 1
    assert checked >= 3  # the two runtimes and the Triton server


#: Where each kind that makes pods holds their pod-level fields: a Deployment's template, an
#: InferenceService's predictor (KServe builds the pod from its pod fields: kserve
#: pkg/controller/v1beta1/inferenceservice/utils/utils.go, MergePodSpec), a Seldon Server's podSpec
#: (merged into its ServerConfig's: test_seldon.py). Runtimes have no pod securityContext (their CRD).
POD_FIELDS = {"Deployment": ("spec", "template", "spec"), "InferenceService": ("spec", "predictor"), "Server": ("spec", "podSpec")}
HWHIAIUSER = MANIFESTS / "components" / "hwhiaiuser"


def hwhiaiuser_gid(component: Path = HWHIAIUSER) -> int:
    """The host's HwHiAiUser group id the component sets (its one literal)."""
    (generator,) = yaml.safe_load((component / "kustomization.yaml").read_text())["configMapGenerator"]
    (literal,) = generator["literals"]
    name, _, value = literal.partition("=")
    assert name == "gid"
    return int(value)


def pod_groups(objects: list[dict]) -> dict[str, list[int]]:
    """The supplementary groups (fsGroup included) of the pods each object makes, by object."""
    groups = {}
    for obj in (obj for obj in objects if obj["kind"] in POD_FIELDS):
        pod = obj
        for key in POD_FIELDS[obj["kind"]]:
            pod = pod[key]
        context = pod.get("securityContext", {})
        groups[f"{obj['kind']} {obj['metadata']['name']}"] = context.get("supplementalGroups", []) + [context.get("fsGroup")]
    return groups


def test_every_pod_has_the_hosts_hwhiaiuser_group():
    # The NPU's device nodes and driver libraries belong to the host's HwHiAiUser group, not to the
    # image's user: without the group the server cannot open the NPU.
    gid, checked = hwhiaiuser_gid(), 0
    for path in OBJECT_FILES:
        for where, groups in pod_groups(documents(path)).items():
            assert gid in groups, f"{relative(path)}: {where}"
            checked += 1
    assert checked == 10  # two Deployments, seven InferenceServices, the Seldon Server


def test_the_hwhiaiuser_group_is_set_in_one_place(kubectl, tmp_path):
    # Another host's id, set in the component only, reaches every pod every kustomization makes.
    shutil.copytree(MANIFESTS, tmp_path / "manifests")
    kustomization = tmp_path / "manifests" / HWHIAIUSER.relative_to(MANIFESTS) / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace(f"gid={hwhiaiuser_gid()}", "gid=4321"))
    assert hwhiaiuser_gid(kustomization.parent) == 4321
    made = {}
    for directory in KUSTOMIZATIONS:
        objects = kustomize(kubectl, tmp_path / "manifests" / directory.relative_to(MANIFESTS))
        made |= {f"{relative(directory)}: {where}": groups for where, groups in pod_groups(objects).items()}
    assert made and all(groups[:1] == [4321] for groups in made.values()), made
    assert {where.partition(":")[0] for where in made} == {
        "manifests/triton", "manifests/mindie/base", "manifests/mindie/vnpu", "manifests/seldon", "manifests/autoscaling/business-hours"}


#: The strategy KServe gives an InferenceService's Deployment without a deploymentStrategy (kserve
#: pkg/controller/v1beta1/inferenceservice/reconcilers/deployment/deployment_reconciler.go,
#: setDefaultDeploymentSpec; 0.15.2 to 0.20.0).
KSERVE_DEFAULT_STRATEGY = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
RAW_MODES = {"RawDeployment", "Standard"}  # "RawDeployment" up to KServe 0.15, "Standard" from 0.16


def rollout_fenceposts(strategy: dict, replicas: int) -> tuple[int, int]:
    """(pods a rollout may start beyond `replicas`, pods it may stop) at once (Kubernetes
    pkg/controller/deployment/util/deployment_util.go, ResolveFenceposts: a percentage of maxSurge rounds
    up, of maxUnavailable down, and if both come to 0 one pod may be unavailable)."""
    if strategy["type"] == "Recreate":
        return 0, replicas
    rolling = strategy["rollingUpdate"]

    def scaled(value: int | str, round_up: bool) -> int:
        if isinstance(value, str):
            exact = int(value.removesuffix("%")) * replicas / 100
            return math.ceil(exact) if round_up else math.floor(exact)
        return value

    surge, unavailable = scaled(rolling["maxSurge"], True), scaled(rolling["maxUnavailable"], False)
    return surge, unavailable or (0 if surge else 1)


def npu_rollouts() -> list[tuple[str, dict, range]]:
    """(where, strategy, replica counts) of every Deployment whose pods take one NPU and that has no
    spare one to roll out on: the Triton Deployment and the one KServe makes of each RawDeployment
    InferenceService, with the replica counts between its minReplicas and maxReplicas. (The MindIE-style
    Deployment keeps all its replicas serving through a rollout and says it needs a spare NPU.)"""
    deployment = the(TRITON / "deployment.yaml", "Deployment")
    assert triton_container()["resources"]["limits"]["huawei.com/Ascend910"] == "1"
    rollouts = [(relative(TRITON / "deployment.yaml"), deployment["spec"]["strategy"], range(deployment["spec"]["replicas"], deployment["spec"]["replicas"] + 1))]
    assert runtime_container()["resources"]["limits"]["huawei.com/Ascend910"] == "1"
    for path in OBJECT_FILES:
        for isvc in (o for o in documents(path) if o["kind"] == "InferenceService"):
            if isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] in RAW_MODES:
                predictor = isvc["spec"]["predictor"]
                least = predictor.get("minReplicas", 1)
                counts = range(least, max(least, predictor.get("maxReplicas", least)) + 1)
                rollouts.append((relative(path), predictor.get("deploymentStrategy", KSERVE_DEFAULT_STRATEGY), counts))
    return rollouts


def test_no_rollout_needs_a_spare_npu():
    # One NPU per pod and often none free: a rollout must stop an old pod before it starts a new one,
    # or the new one stays Pending until the rollout's deadline.
    rollouts = npu_rollouts()
    for where, strategy, counts in rollouts:
        for replicas in counts:
            surge, unavailable = rollout_fenceposts(strategy, replicas)
            assert surge == 0 and unavailable >= 1, f"{where}: with {replicas} replicas a rollout adds {surge}, stops {unavailable}"
    assert len(rollouts) == 4  # Triton and the three RawDeployment services


def test_the_rollout_arithmetic_is_kubernetes():
    default = KSERVE_DEFAULT_STRATEGY
    assert [rollout_fenceposts(default, n) for n in (1, 4, 5)] == [(1, 0), (1, 1), (2, 1)]
    no_surge = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "10%"}}
    assert rollout_fenceposts(no_surge, 4) == (0, 1)  # both 0: one pod may be unavailable


#: Kubernetes' default terminationGracePeriodSeconds.
DEFAULT_GRACE_PERIOD_S = 30
#: Their pods are KServe's to make: their stop is the InferenceServices'. A Seldon Server's stop is its
#: ServerConfig's (Seldon's agent drains it first: test_seldon.py).
NOT_STOPPED_HERE = {"ServingRuntime", "ClusterServingRuntime", "Server"}
#: Triton's --exit-timeout-secs when not given (triton-inference-server/core src/server.cc, InferenceServer()).
TRITON_EXIT_TIMEOUT_S = 30


def shutdown_timeout_s(container: dict) -> float:
    """How long the server in a project image's container may take to stop after SIGTERM, by its flags."""
    if container["image"].startswith("kserve-ascend-triton:"):
        return float(flag_values(container.get("args", [])).get("--exit-timeout-secs", TRITON_EXIT_TIMEOUT_S))
    from kserve_ascend.server.cli import build_parser

    return build_parser().parse_args(container["args"]).shutdown_timeout_s


def pre_stop_delay_s(container: dict) -> float:
    """The seconds a container's preStop hook waits (`sleep N`): the endpoints drop the pod meanwhile."""
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    assert command[:1] == ["sleep"] and len(command) == 2, f"{container['name']}: no preStop delay"
    return float(command[1])


def stopped_servers() -> list[tuple[str, dict, int]]:
    """(where, container, grace period) of every server the manifests have Kubernetes stop: the project's
    images in the Deployments, and the runtime's container in each RawDeployment
    InferenceService, with the service's fields (its preStop hook) merged in as KServe merges them
    (kserve pkg/controller/v1beta1/inferenceservice/utils/utils.go, MergeRuntimeContainers: a strategic merge).
    Not the Knative ones: Knative makes the hook its queue-proxy's drain, the grace period the revision's
    timeoutSeconds (300 s by default), and refuses a runtime's own `lifecycle` (pkg/apis/serving/fieldmask.go)."""
    servers = []
    for path in POD_FILES:
        for obj in documents(path):
            for where, pod in pod_specs(obj):
                for container in pod["containers"]:
                    if obj["kind"] not in NOT_STOPPED_HERE and container["image"].startswith("kserve-ascend"):
                        grace = pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE_PERIOD_S)
                        servers.append((f"{relative(path)}: {where}", container, grace))
    for path in OBJECT_FILES:
        for isvc in (o for o in documents(path) if o["kind"] == "InferenceService"):
            if isvc["metadata"].get("annotations", {}).get("serving.kserve.io/deploymentMode") not in KNATIVE_MODES:
                predictor = isvc["spec"]["predictor"]
                container = {**runtime_container(), **{k: v for k, v in predictor["model"].items() if k == "lifecycle"}}
                servers.append((relative(path), container, predictor.get("terminationGracePeriodSeconds", DEFAULT_GRACE_PERIOD_S)))
    return servers


def test_every_server_stops_within_its_pods_grace_period():
    # SIGTERM comes after the preStop hook; the kubelet kills the container at the grace period's end,
    # and with it every request the server has yet to answer.
    servers = stopped_servers()
    for where, container, grace in servers:
        budget = pre_stop_delay_s(container) + shutdown_timeout_s(container)
        assert budget < grace, f"{where}: {budget} s to stop, {grace} s given"
    # The MindIE-style and Triton Deployments, the three RawDeployment services.
    assert len(servers) == 5
    for path, kind in ((RUNTIME, "ClusterServingRuntime"), (NAMESPACED_RUNTIME, "ServingRuntime")):
        # Knative would refuse every service of a runtime with a hook of its own.
        assert all("lifecycle" not in container for container in the(path, kind)["spec"]["containers"])


# Knative's: canary traffic splitting across revisions, the KPA's concurrency and rps metrics.
KNATIVE_MODES = {"Serverless", "Knative"}  # "Serverless" up to KServe 0.15, read as "Knative" by 0.16+


@pytest.mark.parametrize("path", sorted(p for p in OBJECT_FILES if any(o["kind"] == "InferenceService" for o in documents(p))), ids=relative)
def test_features_of_knative_mode_pin_it(path):
    # Neither works in raw mode, which a cluster may default to (inferenceservice-config's
    # deploy.defaultDeploymentMode; KServe's code falls back to Standard since 0.16 where it is unset).
    for isvc in (o for o in documents(path) if o["kind"] == "InferenceService"):
        predictor = isvc["spec"]["predictor"]
        if "canaryTrafficPercent" in predictor or predictor.get("scaleMetric") in ("concurrency", "rps"):
            assert isvc["metadata"].get("annotations", {}).get("serving.kserve.io/deploymentMode") in KNATIVE_MODES


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
    # pyproject.toml's [project.scripts], as installed (tomllib is Python 3.11+; the tests run on 3.10 too).
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts") if e.dist.name == "kserve-ascend"}
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


def test_the_images_create_their_user_before_switching_to_it():
    uid, gid = image_user(DOCKER / "kserve.Dockerfile")
    steps = expanded(DOCKER / "kserve.Dockerfile")
    (created,) = [i for i, (instruction, arguments) in enumerate(steps) if instruction == "RUN" and "useradd" in arguments]
    run = steps[created][1]
    assert re.search(rf"groupadd -g {gid} HwHiAiUser\b", run) and re.search(rf"useradd -u {uid} -g HwHiAiUser .*-m\b", run)
    assert [i for i, (instruction, _) in enumerate(steps) if instruction == "USER"][-1] > created
    # The Triton image installs as root on the kserve image, then runs as the same user again.
    assert image_user(DOCKER / "triton.Dockerfile") == (uid, gid)


def test_the_triton_image_gives_its_user_the_one_directory_the_server_writes():
    # run_triton.py assembles the backends on every start in its default --backend-directory.
    launcher = run_triton_module()
    default = Path(launcher.parse_args([]).backend_directory).relative_to(ROOT)
    dockerfile = DOCKER / "triton.Dockerfile"
    _, script = entrypoint(dockerfile)
    image_root = posixpath.dirname(posixpath.dirname(script))  # <root>/tools/run_triton.py
    uid, gid = image_user(dockerfile)
    workdir, owned = "/", set()
    for instruction, arguments in expanded(dockerfile):
        if instruction == "WORKDIR":
            workdir = posixpath.join(workdir, arguments)
        elif instruction == "RUN" and (found := re.search(rf"install -d -o {uid} -g {gid} (\S+)", arguments)):
            owned.add(posixpath.join(workdir, found[1]))
    assert posixpath.join(image_root, str(default)) in owned


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=relative)
def test_every_copied_file_is_readable_by_the_images_user(dockerfile):
    # COPY keeps the build context's modes and makes root the owner: "others" must read (and enter).
    patterns = ignore_patterns(dockerfile)
    for source in (source for sources, _ in copies(dockerfile) for source in sources):
        for path in [ROOT / source, *(ROOT / source).rglob("*")]:
            if ignored(str(path.relative_to(ROOT)), patterns):
                continue
            needed = 0o005 if path.is_dir() else 0o004
            assert path.stat().st_mode & needed == needed, f"{relative(path)} is not readable by others"

