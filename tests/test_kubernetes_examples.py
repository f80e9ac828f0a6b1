"""The Kubernetes examples beyond the runtime: gRPC through an InferenceService, autoscaling (Knative,
KEDA), Istio policies, the MindIE-style Deployment (and its vNPU overlay), Seldon Core 2.

Every object is validated against its project's CRD or Kubernetes' schema by
test_manifests.py (all of manifests/); here, what the schemas cannot see: what KServe and Knative
make of the examples (as their sources cited below do it: each supported KServe release's
deployment-mode rules, Knative's field mask against the features docs/kubernetes.md names), the
servers started with the examples' own args and asked what the probes and clients ask, the
autoscaling queries run by the real Prometheus (promtool) on series shaped as the scrape job
stores this server's metrics.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import crd_schema
import jsonschema
import kserve_ascend.server  # noqa: F401  (before tritonclient: it makes kserve importable beside it)
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from conftest import (
    REPOSITORY,
    ROOT,
    Server,
    copy_model,
    free_port,
    start_server,
    start_triton,
    stop_server,
    wait_for,
)
from google.protobuf import text_format
from kubernetes.utils.quantity import parse_quantity
from test_manifests import (  # noqa: F401  (runtime_ports, kubectl: fixtures)
    KNATIVE_MODES,
    MANIFESTS,
    NAMESPACED_RUNTIME,
    RUNTIME,
    TRITON,
    documents,
    flag_values,
    kubectl,
    kustomize,
    mounted_configs,
    passes,
    probe_action,
    runtime_container,
    runtime_ports,
    substitute,
    the,
    triton_container,
)
from tritonclient.grpc import model_config_pb2

GRPC_KNATIVE = MANIFESTS / "examples" / "grpc" / "inferenceservice-yolov8n-grpc.yaml"
GRPC_RAW = MANIFESTS / "examples" / "grpc" / "inferenceservice-yolov8n-raw.yaml"
AUTOSCALING = MANIFESTS / "autoscaling"
MESH = MANIFESTS / "mesh"
MINDIE = MANIFESTS / "mindie"
SELDON = MANIFESTS / "seldon"
SCRAPE_CONFIG = MANIFESTS / "monitoring" / "prometheus-scrape-config.yaml"
DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
DOCS = ROOT / "docs" / "kubernetes.md"

INFERENCE_SERVICES = sorted(
    path for path in MANIFESTS.rglob("*.yaml") if any(doc.get("kind") == "InferenceService" for doc in documents(path) if isinstance(doc, dict))
)


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def runtime_flags() -> dict[str, str]:
    return flag_values(runtime_container()["args"])


def max_batch_size(model: str) -> int:
    (value,) = re.findall(r"^max_batch_size:\s*(\d+)", (REPOSITORY / model / "config.pbtxt").read_text(), re.MULTILINE)
    return int(value)


# --- The CRD validator itself -------------------------------------------------------------


def refused(obj: dict) -> str:
    with pytest.raises(jsonschema.ValidationError) as error:
        crd_schema.validate(obj)
    return str(error.value)


def test_the_vendored_crds_serve_the_kinds_of_the_manifests():
    assert crd_schema.kinds() >= {
        ("serving.kserve.io/v1beta1", "InferenceService"),
        ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"),
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("networking.istio.io/v1", "DestinationRule"),
        ("networking.istio.io/v1alpha3", "EnvoyFilter"),
        ("mlops.seldon.io/v1alpha1", "Server"),
        ("mlops.seldon.io/v1alpha1", "Model"),
    }
    with pytest.raises(crd_schema.UnknownKind):
        crd_schema.validate({"apiVersion": "keda.sh/v1", "kind": "ScaledObject"})  # a version no CRD serves


def test_the_crd_validator_refuses_what_the_api_server_would_prune_or_reject():
    isvc = the(AUTOSCALING / "inferenceservice-keda.yaml", "InferenceService")
    scaled = the(AUTOSCALING / "business-hours" / "scaledobject.yaml", "ScaledObject")
    rule = the(MESH / "destinationrule.yaml", "DestinationRule")
    for obj in (isvc, scaled, rule):
        crd_schema.validate(obj)  # as written

    wrong = copy.deepcopy(scaled)
    wrong["spec"]["minReplicas"] = wrong["spec"].pop("minReplicaCount")  # KServe's name in KEDA's object: pruned
    assert "'minReplicas' was unexpected" in refused(wrong)
    wrong = copy.deepcopy(rule)
    wrong["spec"]["trafficPolicy"]["outlierDetection"]["consecutive5xxError"] = 5
    assert "consecutive5xxError" in refused(wrong)
    wrong = copy.deepcopy(isvc)
    wrong["metadata"]["annotation"] = {}  # metadata is ObjectMeta
    assert "'annotation' was unexpected" in refused(wrong)
    wrong = copy.deepcopy(isvc)
    wrong["spec"]["predictor"]["maxReplicas"] = "4"
    assert "is not of type 'integer'" in refused(wrong)
    wrong["spec"]["predictor"]["maxReplicas"] = 2**31  # format: int32
    assert "int32" in refused(wrong)
    wrong = copy.deepcopy(isvc)
    wrong["spec"]["predictor"]["model"]["ports"] = [{"name": "a", "containerPort": 8081}, {"name": "b", "containerPort": 8081}]
    assert "duplicate keys" in refused(wrong)  # x-kubernetes-list-type: map, keyed by containerPort and protocol


def test_the_crd_validator_honours_int_or_string_and_preserve_unknown_fields():
    isvc = the(AUTOSCALING / "inferenceservice-keda.yaml", "InferenceService")
    (external,) = [m["external"] for m in isvc["spec"]["predictor"]["autoScaling"]["metrics"] if m["type"] == "External"]
    for value in (40, "40", "500m"):  # x-kubernetes-int-or-string, with the Quantity pattern on strings
        external["target"]["value"] = value
        crd_schema.validate(isvc)
    external["target"]["value"] = "forty"
    assert "does not match" in refused(isvc)
    # An EnvoyFilter's patch value is any Envoy configuration (x-kubernetes-preserve-unknown-fields);
    # the fields around it are not.
    envoy_filter = the(MESH / "envoyfilter-local-ratelimit.yaml", "EnvoyFilter")
    envoy_filter["spec"]["configPatches"][0]["patch"]["value"]["anything"] = {"at": ["all"]}
    crd_schema.validate(envoy_filter)
    envoy_filter["spec"]["configPatches"][0]["patch"]["valu"] = {}
    assert "'valu' was unexpected" in refused(envoy_filter)


# --- Every InferenceService is one the runtime serves ------------------------------------


@pytest.mark.parametrize("path", INFERENCE_SERVICES, ids=relative)
def test_every_inference_service_is_served_by_the_runtime_in_a_pinned_mode(path):
    runtime = the(RUNTIME, "ClusterServingRuntime")
    isvc = the(path, "InferenceService")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    # KServe 0.16+ defaults to Standard where 0.15 defaulted to Serverless: each example says which,
    # by KServe 0.16+'s names (test_kserve_takes_every_inference_service_in_the_mode_it_names).
    assert isvc["metadata"]["annotations"][DEPLOYMENT_MODE] in ("Knative", "Standard")
    assert model["storageUri"].endswith("/")  # a prefix: v1/ and not v10/


# --- The deployment-mode names of each KServe release --------------------------------------

#: KServe 0.16 renamed the modes and kept the old names as deprecated (kserve pkg/constants/constants.go,
#: LegacyServerless and LegacyRawDeployment).
LEGACY_NAMES = {"Serverless": "Knative", "RawDeployment": "Standard"}
#: The mode each name means.
MODE_OF = {"Knative": "knative", "Serverless": "knative", "Standard": "raw", "RawDeployment": "raw"}


@dataclass(frozen=True)
class KServe:
    """What a KServe release's webhooks and controller make of serving.kserve.io/deploymentMode
    (kserve pkg/apis/serving/v1beta1/inference_service_defaults.go, DefaultInferenceService;
    inference_service_validation.go, validateDeploymentMode and validateAutoScalingCompExtension;
    pkg/controller/v1beta1/inferenceservice/utils/utils.go, GetDeploymentMode)."""

    releases: str
    names: dict[str, str]  # mode -> the name its code compares annotations with
    rewrites_legacy: bool  # the defaulting webhook rewrites the old names to the new (0.17+)
    parses_status: bool  # validateDeploymentMode reads a recorded old name as the new (0.19+)
    component: str | None  # what docs/kubernetes.md has its users apply the manifests through

    def read(self, name: str | None) -> str | None:
        """A name as GetDeploymentMode reads it: 0.16+ maps the old names to the new."""
        return LEGACY_NAMES.get(name, name) if self.names["knative"] == "Knative" else name

    def defaulted(self, isvc: dict, default: str) -> dict:
        """The object after the defaulting webhook (on create and on update), in a cluster whose
        deploy.defaultDeploymentMode is `default`."""
        annotations = dict(isvc["metadata"].get("annotations", {}))
        name = annotations.get(DEPLOYMENT_MODE)
        if name is not None and self.rewrites_legacy:
            annotations[DEPLOYMENT_MODE] = LEGACY_NAMES.get(name, name)
        if name is None and default == "raw":
            annotations[DEPLOYMENT_MODE] = self.names["raw"]
        return {**isvc, "metadata": {**isvc["metadata"], "annotations": annotations}}

    def refusal(self, isvc: dict, recorded: str | None = None) -> str | None:
        """Why the validating webhook refuses the (defaulted) object, on update of one whose status
        records `recorded`; None if it takes it."""
        name = isvc["metadata"]["annotations"].get(DEPLOYMENT_MODE)
        if recorded is not None:
            status = self.read(recorded) if self.parses_status else recorded
            if name is not None and name != status:
                return f"update rejected: deploymentMode cannot be changed from '{status}' to '{name}'"
        # Anything but the raw mode's exact name is validated as Knative's KPA.
        if name != self.names["raw"] and "deploymentStrategy" in isvc["spec"]["predictor"]:
            return "customizing deploymentStrategy is only supported for raw deployment mode"
        return None

    def recorded(self, isvc: dict, default: str) -> str:
        """The mode the controller runs a new service in and records in status.deploymentMode: the
        annotation's if it knows the name, else the cluster's default."""
        name = self.read(isvc["metadata"]["annotations"].get(DEPLOYMENT_MODE))
        return name if name in self.names.values() else self.names[default]


NEW_NAMES = {"knative": "Knative", "raw": "Standard"}
KSERVE_RELEASES = [
    KServe("0.15.2", {"knative": "Serverless", "raw": "RawDeployment"}, False, False, "kserve-0.15"),
    KServe("0.16.0", NEW_NAMES, False, False, None),  # kserve/kserve#4798: old names refused on update
    KServe("0.17.0-0.18.1", NEW_NAMES, True, False, None),
    KServe("0.19.0-0.20.0", NEW_NAMES, True, True, None),
]


def applied(kubectl: str, path: Path, kserve: KServe, workdir: Path) -> list[dict]:
    """The InferenceServices of `path` as docs/kubernetes.md has them applied to `kserve`: as they are,
    or through a kustomization of the user's that lists them (a copy of the file, or the directory
    that holds them) and the release's component."""
    if kserve.component is None:
        return [doc for doc in documents(path) if doc["kind"] == "InferenceService"]
    if (path.parent / "kustomization.yaml").exists():
        resources = [os.path.relpath(path.parent, workdir)]
    else:
        shutil.copy(path, workdir)
        resources = [path.name]
    component = os.path.relpath(MANIFESTS / "components" / kserve.component, workdir)
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump({"resources": resources, "components": [component]}))
    return [obj for obj in kustomize(kubectl, workdir) if obj["kind"] == "InferenceService"]


@pytest.mark.parametrize("kserve", KSERVE_RELEASES, ids=lambda kserve: kserve.releases)
@pytest.mark.parametrize("path", INFERENCE_SERVICES, ids=relative)
def test_kserve_takes_every_inference_service_and_its_updates_in_the_mode_it_names(kubectl, tmp_path, path, kserve):
    meant = {doc["metadata"]["name"]: MODE_OF[doc["metadata"]["annotations"][DEPLOYMENT_MODE]]
             for doc in documents(path) if doc["kind"] == "InferenceService"}
    for isvc in applied(kubectl, path, kserve, tmp_path):
        name = isvc["metadata"]["name"]
        for default in ("knative", "raw"):  # the cluster's deploy.defaultDeploymentMode
            created = kserve.defaulted(isvc, default)
            assert kserve.refusal(created) is None, kserve.refusal(created)
            recorded = kserve.recorded(created, default)
            assert recorded == kserve.names[meant[name]], f"{name} runs in {recorded}"
            # Applied again, or changed (a canary's new storageUri): every update passes the same checks.
            updated = kserve.defaulted(isvc, default)
            assert kserve.refusal(updated, recorded) is None, kserve.refusal(updated, recorded)


def test_the_support_matrix_says_how_to_apply_the_manifests_to_each_release():
    rows = {cells[1].strip(): cells[3].strip() for cells in (line.split("|") for line in DOCS.read_text().splitlines())
            if len(cells) > 3 and re.fullmatch(r" 0\.\d+\.\d+( to 0\.\d+\.\d+)? ", cells[1])}
    assert [release.replace(" to ", "-") for release in rows] == [kserve.releases for kserve in KSERVE_RELEASES]
    for kserve, how in zip(KSERVE_RELEASES, rows.values()):
        assert how == (f"through `manifests/components/{kserve.component}`" if kserve.component else "as they are")


def test_the_release_rules_refuse_what_kserve_refuses():
    isvc = the(GRPC_RAW, "InferenceService")
    old_names = {**isvc, "metadata": {**isvc["metadata"], "annotations": {DEPLOYMENT_MODE: "RawDeployment"}}}
    kserve_0_15, kserve_0_16, kserve_0_17, _ = KSERVE_RELEASES
    # kserve/kserve#4798: 0.16.0 records the new name and compares it with the old one.
    without_strategy = copy.deepcopy(old_names)
    del without_strategy["spec"]["predictor"]["deploymentStrategy"]
    recorded = kserve_0_16.recorded(kserve_0_16.defaulted(without_strategy, "knative"), "knative")
    assert recorded == "Standard"
    assert "cannot be changed from 'Standard' to 'RawDeployment'" in kserve_0_16.refusal(kserve_0_16.defaulted(without_strategy, "knative"), recorded)
    # ... and validates a deploymentStrategy beside the old name as Knative's.
    assert "deploymentStrategy" in kserve_0_16.refusal(kserve_0_16.defaulted(old_names, "knative"))
    assert kserve_0_17.refusal(kserve_0_17.defaulted(old_names, "knative")) is None  # rewritten first
    # 0.15 does not know the new names: the cluster's default mode, and the strategy refused.
    assert kserve_0_15.recorded(kserve_0_15.defaulted(isvc, "knative"), "knative") == "Serverless"
    assert "deploymentStrategy" in kserve_0_15.refusal(kserve_0_15.defaulted(isvc, "knative"))


# --- gRPC through an InferenceService ------------------------------------------------------


POD_SPEC, CONTAINER = "io.k8s.api.core.v1.PodSpec", "io.k8s.api.core.v1.Container"


def strategic_merge(dst, src, schema: dict):
    """Kubernetes' strategic merge of `src` onto `dst`, values of the API type `schema` names
    (k8s.io/apimachinery pkg/util/strategicpatch): structs and maps key by key, lists whose
    patch strategy is merge item by item on their patch merge key, anything else replaced."""
    name = schema.get("$ref", "").rpartition("/")[2]
    definition = crd_schema.kubernetes_definition(name) if name else schema
    if isinstance(dst, dict) and isinstance(src, dict) and ("properties" in definition or "additionalProperties" in definition):
        fields = definition.get("properties", {})
        return {**dst, **{key: strategic_merge(dst[key], value, fields.get(key) or definition.get("additionalProperties", {}))
                          if key in dst else value for key, value in src.items()}}
    key = definition.get("x-kubernetes-patch-merge-key")
    if isinstance(dst, list) and isinstance(src, list) and key and "merge" in definition.get("x-kubernetes-patch-strategy", ""):
        items = {item[key]: item for item in dst}
        for item in src:
            items[item[key]] = strategic_merge(items[item[key]], item, definition["items"]) if item[key] in items else item
        return list(items.values())
    return src


def merged_container(isvc: dict, runtime: dict | None = None) -> dict:
    """The predictor container KServe builds: the runtime's, with the service's model fields merged
    in by Kubernetes' strategic merge (ports keyed by containerPort), the args appended
    (kserve pkg/controller/v1beta1/inferenceservice/utils/utils.go, MergeRuntimeContainers)."""
    (container,) = (runtime or the(RUNTIME, "ClusterServingRuntime"))["spec"]["containers"]
    fields = crd_schema.kubernetes_definition(CONTAINER)["properties"]
    model = {key: value for key, value in isvc["spec"]["predictor"]["model"].items() if key in fields}
    merged = strategic_merge(copy.deepcopy(container), model, {"$ref": CONTAINER})
    if "args" in model:
        merged["args"] = container.get("args", []) + model["args"]
    return merged


def knative_probes(container: dict) -> tuple[dict, dict, int]:
    """(liveness probe as the kubelet runs it, readiness probe as queue-proxy runs it, the port Knative serves).
    Knative serves the one declared port and moves an httpGet or tcpSocket liveness probe to it
    (knative/serving 1.15 pkg/reconciler/revision/resources/deploy.go, rewriteUserLivenessProbe);
    queue-proxy runs the readiness probe itself, on the port it names, over HTTP/1 (resources/queue.go,
    applyReadinessProbeDefaults; pkg/queue/readiness/probe.go, MaxProtoMajor 1)."""
    (port,) = container["ports"]
    liveness = copy.deepcopy(container["livenessProbe"])
    probe_action(liveness)["port"] = port["containerPort"]
    return liveness, container["readinessProbe"], port["containerPort"]


def test_the_knative_grpc_service_declares_the_servers_grpc_port_as_h2c():
    isvc = the(GRPC_KNATIVE, "InferenceService")
    assert isvc["metadata"]["annotations"][DEPLOYMENT_MODE] == "Knative"
    assert isvc["spec"]["predictor"]["model"]["protocolVersion"] == "grpc-v2"
    (port,) = merged_container(isvc)["ports"]  # Knative takes one port
    assert port["name"] == "h2c"  # how Knative knows it is HTTP/2 cleartext
    assert port["containerPort"] == int(runtime_flags()["--grpc_port"])


def raw_service_ports(container: dict) -> list[dict]:
    """The Service ports KServe makes of the predictor container in RawDeployment mode: the first
    declared port as 80, the others under their own numbers, appProtocol kubernetes.io/h2c where the
    name holds grpc or h2c (kserve 0.15 pkg/controller/v1beta1/inferenceservice/reconcilers/service/
    service_reconciler.go, createDefaultSvc and getAppProtocol; unchanged up to 0.20)."""
    ports = container.get("ports") or [{"name": "predictor", "containerPort": 8080}]
    service = []
    for i, port in enumerate(ports):
        grpc = "grpc" in port["name"] or "h2c" in port["name"]
        service.append({"name": port["name"], "port": 80 if i == 0 else port["containerPort"], "targetPort": port["containerPort"],
                        **({"appProtocol": "kubernetes.io/h2c"} if grpc else {})})
    return service


def test_the_raw_service_exposes_rest_on_80_and_grpc_on_its_own_port():
    isvc = the(GRPC_RAW, "InferenceService")
    assert isvc["metadata"]["annotations"][DEPLOYMENT_MODE] == "Standard"
    flags = runtime_flags()
    rest, grpc = raw_service_ports(merged_container(isvc))
    assert rest == {"name": "http", "port": 80, "targetPort": int(flags["--http_port"])}
    assert grpc == {"name": "grpc", "port": int(flags["--grpc_port"]), "targetPort": int(flags["--grpc_port"]),
                    "appProtocol": "kubernetes.io/h2c"}
    # The REST example declares no port: its Service is 80 -> 8080 only, so it carries no gRPC.
    rest_only = the(MANIFESTS / "examples" / "inferenceservice-yolov8n.yaml", "InferenceService")
    assert [port["targetPort"] for port in raw_service_ports(merged_container(rest_only))] == [int(flags["--http_port"])]


def test_knative_serves_grpc_and_both_probes_pass_on_the_running_runtime(runtime_ports):
    liveness, readiness, served = knative_probes(merged_container(the(GRPC_KNATIVE, "InferenceService")))
    assert passes(liveness, runtime_ports[probe_action(liveness)["port"]])
    assert passes(readiness, runtime_ports[probe_action(readiness)["port"]])
    with grpcclient.InferenceServerClient(f"127.0.0.1:{runtime_ports[served]}") as client:
        assert client.is_server_ready() and client.is_model_ready("yolov8n")
    # Why the runtime's liveness probe is TCP: an HTTP/1.1 probe moved to the gRPC port gets no HTTP answer.
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{runtime_ports[served]}/v2/health/live", timeout=5)


def test_the_raw_services_ports_reach_rest_and_grpc_on_the_running_runtime(runtime_ports):
    container = merged_container(the(GRPC_RAW, "InferenceService"))
    rest, grpc = raw_service_ports(container)
    for probe in ("livenessProbe", "readinessProbe"):  # as the kubelet runs them, unchanged in RawDeployment
        assert passes(container[probe], runtime_ports[probe_action(container[probe])["port"]])
    assert requests.get(f"http://127.0.0.1:{runtime_ports[rest['targetPort']]}/v2/models/yolov8n", timeout=5).status_code == 200
    with grpcclient.InferenceServerClient(f"127.0.0.1:{runtime_ports[grpc['targetPort']]}") as client:
        assert client.is_model_ready("yolov8n")


# --- What Knative takes -----------------------------------------------------------------------

#: Knative's field mask (tests/upstream/: its source and release).
KNATIVE_MASK = yaml.safe_load((ROOT / "tests" / "upstream" / "knative-serving-v1.15.0-fieldmask.yaml").read_text())
#: The runtime's pod fields KServe puts under the service's (kserve pkg/controller/v1beta1/inferenceservice/
#: utils/utils.go, MergePodSpec).
RUNTIME_POD_FIELDS = ("nodeSelector", "affinity", "tolerations", "volumes", "imagePullSecrets")
KNATIVE_SERVICES = [path for path in INFERENCE_SERVICES if the(path, "InferenceService")["metadata"]["annotations"][DEPLOYMENT_MODE] in KNATIVE_MODES]

def knative_pod(isvc: dict, runtime: dict) -> dict:
    """The pod spec KServe gives the Knative Service of a Knative-mode InferenceService: the runtime's
    pod fields with the predictor's merged over them, and one container, the runtime's with the
    model's fields merged in (kserve pkg/controller/v1beta1/inferenceservice/components/predictor.go,
    buildPodSpec)."""
    fields = crd_schema.kubernetes_definition(POD_SPEC)["properties"]
    pod = strategic_merge({key: runtime["spec"][key] for key in RUNTIME_POD_FIELDS if key in runtime["spec"]},
                          {key: value for key, value in isvc["spec"]["predictor"].items() if key in fields},
                          {"$ref": POD_SPEC})
    return {**pod, "containers": [merged_container(isvc, runtime)]}


def knative_fields(value: dict, type_name: str = POD_SPEC, path: str = "spec.template.spec") -> tuple[dict[str, str], list[str]]:
    """({field: the config-features flag that lets it through}, [fields no flag lets through]) of a
    value of an API type, by Knative's field mask, at every level Knative applies it. A field counts as
    set when it is present (Knative's CheckDisallowedFields: different from its Go zero value, which
    for the pointer fields, as privileged, includes false)."""
    mask = KNATIVE_MASK["masks"].get(type_name)
    if mask is None:
        return {}, []
    properties = crd_schema.kubernetes_definition(type_name)["properties"]
    gated, refused = {}, []
    for key, field in value.items():
        where = f"{path}.{key}"
        if key in mask.get("gated", {}):
            gated[where] = mask["gated"][key]
        elif key not in mask.get("allowed", []) and not (key in mask.get("false_only", []) and field is False):
            refused.append(where)
            continue
        schema = properties[key]
        inner = (schema.get("items") or schema).get("$ref", "").rpartition("/")[2]
        for i, item in enumerate(field if "items" in schema else [field]):
            if inner and isinstance(item, dict):
                more_gated, more_refused = knative_fields(item, inner, f"{where}[{i}]" if "items" in schema else where)
                gated |= more_gated
                refused += more_refused
    return gated, refused


def runtimes(kubectl: str) -> dict[str, dict]:
    """Every runtime an InferenceService may run on, by the manifest that makes it."""
    found = {relative(RUNTIME): the(RUNTIME, "ClusterServingRuntime"), relative(NAMESPACED_RUNTIME): the(NAMESPACED_RUNTIME, "ServingRuntime")}
    for overlay in sorted((MANIFESTS / "overlays").iterdir()):
        (found[relative(overlay)],) = kustomize(kubectl, overlay)
    return found


def documented_features() -> list[tuple[list[str], set[str]]]:
    """(manifest paths or patterns, config-features flags) of each row of docs/kubernetes.md's table
    of the Knative features each manifest needs."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Manifest, in Knative mode |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        manifests, flags = line.strip("|").split("|")[:2]
        rows.append((re.findall(r"`(manifests/[^`]+)`", manifests), set(re.findall(r"`(kubernetes\.[\w.-]+)`", flags))))
    return rows


def documented_for(manifest: str) -> set[str]:
    return {flag for patterns, flags in documented_features() if any(fnmatch.fnmatch(manifest, p) for p in patterns) for flag in flags}


def needed(gated: dict[str, str]) -> set[str]:
    return set(gated.values()) - set(KNATIVE_MASK["enabled_by_default"])


@pytest.mark.parametrize("path", KNATIVE_SERVICES, ids=relative)
def test_knative_takes_each_service_on_each_runtime_with_the_features_the_documentation_names(kubectl, path):
    isvc = the(path, "InferenceService")
    for runtime_path, runtime in runtimes(kubectl).items():
        gated, refused = knative_fields(knative_pod(isvc, runtime))
        assert refused == [], f"{relative(path)} on {runtime_path}: Knative refuses {refused}"
        named = documented_for(relative(path)) | documented_for(runtime_path)
        assert needed(gated) <= named, f"{relative(path)} on {runtime_path}: {gated}; docs/kubernetes.md names {named}"


def test_the_documentation_names_no_knative_feature_a_manifest_does_not_need(kubectl):
    bare = {"spec": {"predictor": {"model": {}}}}  # a service of no pod fields: what a runtime needs
    needs = {relative(path): needed(knative_fields(knative_pod(the(path, "InferenceService"), the(RUNTIME, "ClusterServingRuntime")))[0])
             for path in KNATIVE_SERVICES}
    needs |= {where: needed(knative_fields(knative_pod(bare, runtime))[0]) for where, runtime in runtimes(kubectl).items()}
    for patterns, flags in documented_features():
        matched = [manifest for manifest in needs if any(fnmatch.fnmatch(manifest, pattern) for pattern in patterns)]
        assert matched, patterns
        assert flags == set().union(*(needs[manifest] for manifest in matched)), (patterns, flags)


def test_the_knative_mask_refuses_what_knative_refuses(kubectl):
    isvc = the(MANIFESTS / "examples" / "inferenceservice-yolov8n.yaml", "InferenceService")
    overlay = runtimes(kubectl)["manifests/overlays/ascend910b"]
    gated, refused = knative_fields(knative_pod(isvc, overlay))
    assert gated == {"spec.template.spec.nodeSelector": "kubernetes.podspec-nodeselector",
                     "spec.template.spec.securityContext": "kubernetes.podspec-securitycontext"} and refused == []
    privileged = copy.deepcopy(overlay)
    privileged["spec"]["containers"][0]["securityContext"]["privileged"] = False  # refused up to Knative 1.16
    hook = copy.deepcopy(isvc)
    hook["spec"]["predictor"]["model"]["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    hook["spec"]["predictor"]["terminationGracePeriodSeconds"] = 30
    assert knative_fields(knative_pod(isvc, privileged))[1] == ["spec.template.spec.containers[0].securityContext.privileged"]
    assert knative_fields(knative_pod(hook, overlay))[1] == ["spec.template.spec.terminationGracePeriodSeconds",
                                                            "spec.template.spec.containers[0].lifecycle"]


# --- Autoscaling ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [AUTOSCALING / "inferenceservice-knative.yaml", MANIFESTS / "examples" / "inferenceservice-yolov8n.yaml"],
                         ids=relative)
def test_knative_scales_out_where_the_comments_say(path):
    isvc = the(path, "InferenceService")
    predictor, annotations = isvc["spec"]["predictor"], isvc["metadata"]["annotations"]
    assert annotations[DEPLOYMENT_MODE] == "Knative" and predictor["scaleMetric"] == "concurrency"
    # Knative's target per replica: scaleTarget x utilization (default 70 %, config-autoscaler).
    utilization = int(annotations.get("autoscaling.knative.dev/target-utilization-percentage", 70))
    per_replica = predictor["scaleTarget"] * utilization / 100
    text = re.sub(r"\n\s*#\s*", " ", path.read_text())  # the comments as one line
    assert f"{predictor['scaleTarget']} x {utilization} % = {per_replica:g} requests in flight per replica" in text
    most = predictor["maxReplicas"]
    steps = [f"1 replica up to {per_replica:g} in flight", *(f"{n} up to {n * per_replica:g}" for n in range(2, most)), f"{most} beyond"]
    assert ", ".join(steps) in text, steps
    # The reason given: a batch executing while the next fills, two full batches at most.
    assert max_batch_size("yolov8n") <= per_replica <= 2 * max_batch_size("yolov8n")


def test_the_keda_service_is_one_kserve_turns_into_a_scaled_object():
    isvc = the(AUTOSCALING / "inferenceservice-keda.yaml", "InferenceService")
    annotations, predictor = isvc["metadata"]["annotations"], isvc["spec"]["predictor"]
    assert annotations["serving.kserve.io/autoscalerClass"] == "keda"
    assert annotations[DEPLOYMENT_MODE] == "Standard"  # KServe makes ScaledObjects in raw mode only
    # KServe's webhook refuses scaleMetric with KEDA, a cpu target that is not Utilization, an External
    # metric without query or value (kserve pkg/apis/serving/v1beta1/inference_service_validation.go,
    # validateScalingKedaCompExtension).
    assert "scaleMetric" not in predictor
    metrics = {metric["type"]: metric for metric in predictor["autoScaling"]["metrics"]}
    assert metrics["Resource"]["resource"]["target"]["type"] == "Utilization"
    external = metrics["External"]["external"]
    assert external["metric"]["backend"] == "prometheus" and external["metric"]["query"] and external["target"]["value"]


def test_the_business_hours_scaled_object_drives_the_services_deployment(kubectl):
    objects = {obj["kind"]: obj for obj in kustomize(kubectl, AUTOSCALING / "business-hours")}
    isvc, scaled = objects["InferenceService"], objects["ScaledObject"]
    assert isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "external"
    assert isvc["metadata"]["annotations"][DEPLOYMENT_MODE] == "Standard"
    spec = scaled["spec"]
    # KServe names the predictor's Deployment <service>-predictor (kserve pkg/constants, PredictorServiceName).
    assert spec["scaleTargetRef"]["name"] == f"{isvc['metadata']['name']}-predictor"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (isvc["spec"]["predictor"]["minReplicas"], isvc["spec"]["predictor"]["maxReplicas"])
    triggers = {trigger["type"]: trigger for trigger in spec["triggers"]}
    assert set(triggers) == {"cron", "prometheus", "cpu"}
    cron = triggers["cron"]["metadata"]
    # KEDA's cron scaler: an IANA zone, and standard five-field schedules (robfig/cron's parser).
    assert set(cron) == {"timezone", "start", "end", "desiredReplicas"}
    assert (Path("/usr/share/zoneinfo") / cron["timezone"]).is_file()
    for schedule in (cron["start"], cron["end"]):
        assert len(schedule.split()) == 5
    assert spec["minReplicaCount"] < int(cron["desiredReplicas"]) <= spec["maxReplicaCount"]
    assert {"serverAddress", "query", "threshold"} <= set(triggers["prometheus"]["metadata"])
    assert triggers["cpu"]["metadata"]["containerName"] == runtime_container()["name"]


def autoscaling_queries() -> list:
    """(where, PromQL) of every request-rate query the autoscaling examples give KEDA."""
    isvc = the(AUTOSCALING / "inferenceservice-keda.yaml", "InferenceService")
    queries = [("inferenceservice-keda.yaml", m["external"]["metric"]["query"])
               for m in isvc["spec"]["predictor"]["autoScaling"]["metrics"] if m["type"] == "External"]
    scaled = the(AUTOSCALING / "business-hours" / "scaledobject.yaml", "ScaledObject")
    queries += [("business-hours/scaledobject.yaml", t["metadata"]["query"]) for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    return [pytest.param(where, query, id=where) for where, query in queries]


def exposed_series(url: str, metric: str) -> list[dict[str, str]]:
    """The label sets of `metric`'s samples in a running server's exposition."""
    samples = []
    for line in requests.get(url, timeout=5).text.splitlines():
        if line.startswith(metric + "{"):
            samples.append(dict(re.findall(r'(\w+)="([^"]*)"', line[len(metric) + 1:line.rindex("}")])))
    return samples


@pytest.mark.parametrize("where, query", autoscaling_queries())
def test_each_request_rate_query_sums_this_services_requests_per_second_in_prometheus(mindie_server, tmp_path, where, query):
    """promtool (the real Prometheus engine) evaluates the query over two pods of the service, and
    pods of another service and another namespace that it must leave out. The series carry the
    metric and labels the running server exposes and the labels the scrape job adds."""
    (metric,) = set(re.findall(r"rate\((\w+)\{", query))
    selectors = dict(re.findall(r'(\w+)="([^"]*)"', query))
    added = {rule["target_label"] for rule in yaml.safe_load(SCRAPE_CONFIG.read_text())[0]["relabel_configs"] if "target_label" in rule}
    assert set(selectors) <= added, f"{where}: the scrape job adds no label {set(selectors) - added}"
    server_labels = exposed_series(f"http://127.0.0.1:{mindie_server['metrics']}/metrics", metric)
    assert server_labels, f"the server exposes no {metric}"

    def series(pod: str, per_second: int, **labels: str) -> dict:
        names = {**server_labels[0], **selectors, "pod": pod, **labels}
        text = ", ".join(f'{key}="{value}"' for key, value in sorted(names.items()))
        return {"series": f"{metric}{{{text}}}", "values": f"0+{per_second * 15}x12"}  # a sample every 15 s

    # One pod of the service more for each selector, with that label another value: left out.
    others = [series(f"other-{key}", 1000, **{key: "elsewhere"}) for key in selectors]
    tests = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [{
            "interval": "15s",
            "input_series": [series("a", 10), series("b", 20), *others],
            "promql_expr_test": [{"expr": query, "eval_time": "3m", "exp_samples": [{"labels": "{}", "value": 30}]}],
        }],
    }
    file = tmp_path / "query_test.yml"
    file.write_text(yaml.safe_dump(tests))
    result = subprocess.run(["promtool", "test", "rules", str(file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- Istio ---------------------------------------------------------------------------------


def test_the_mesh_policies_name_the_pods_of_a_raw_inference_service(kubectl):
    objects = {obj["kind"]: obj for obj in kustomize(kubectl, MESH)}
    isvc = the(GRPC_RAW, "InferenceService")
    name = isvc["metadata"]["name"]
    assert isvc["metadata"]["annotations"][DEPLOYMENT_MODE] == "Standard"  # its pods sit behind <name>-predictor
    assert objects["DestinationRule"]["spec"]["host"] == f"{name}-predictor"
    # KServe labels every pod of a service serving.kserve.io/inferenceservice: <name> (predictor.go, buildObjectMeta).
    assert objects["EnvoyFilter"]["spec"]["workloadSelector"]["labels"] == {"serving.kserve.io/inferenceservice": name}
    (patch,) = objects["EnvoyFilter"]["spec"]["configPatches"]
    assert patch["match"]["context"] == "SIDECAR_INBOUND"  # each pod's own sidecar: a limit per replica
    value = patch["patch"]["value"]
    assert value["name"] == "envoy.filters.http.local_ratelimit"
    assert value["typed_config"]["@type"].endswith("envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit")
    bucket = value["typed_config"]["token_bucket"]
    assert bucket["max_tokens"] >= bucket["tokens_per_fill"] > 0
    # Enabled and enforced for every request (a percentage of 100).
    for key in ("filter_enabled", "filter_enforced"):
        assert value["typed_config"][key]["default_value"] == {"numerator": 100, "denominator": "HUNDRED"}
    outlier = objects["DestinationRule"]["spec"]["trafficPolicy"]["outlierDetection"]
    assert outlier["consecutive5xxErrors"] > 1 and 0 < outlier["maxEjectionPercent"] < 100  # never every pod


# --- The MindIE-style Deployment -----------------------------------------------------------


def mindie(kind: str) -> dict:
    return the(MINDIE / "base" / ("deployment.yaml" if kind == "Deployment" else "service.yaml"), kind)


def mindie_container() -> dict:
    (container,) = mindie("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def mindie_server(tmp_path_factory) -> dict[int | str, int]:
    """The Deployment's container as it runs: the image's entrypoint (kserve-ascend) with the
    container's args, ports and model_dir substituted, on the repository the init container
    downloads; yields each port of the manifest (number or name) -> the port it has here."""
    from kserve_ascend.server.cli import build_parser

    container = mindie_container()
    build_parser().parse_args(container["args"])  # the server's own flags, or SystemExit
    repository = tmp_path_factory.mktemp("mnt_models")
    copy_model("yolov8n", repository)
    given = flag_values(container["args"])
    ports = {flag: free_port() for flag in ("--http_port", "--grpc_port", "--metrics_port")}
    command = [str(Path(sys.executable).with_name("kserve-ascend")),
               *substitute(container["args"], {"--model_dir": str(repository), **{f: str(p) for f, p in ports.items()}})]
    log = repository.parent / "mindie.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    server = Server(process, ports["--http_port"], ports["--grpc_port"], log, ports["--metrics_port"])
    port_of: dict[int | str, int] = {int(given[flag]): port for flag, port in ports.items()}
    port_of |= {port["name"]: port_of[port["containerPort"]] for port in container["ports"]}
    wait_for(lambda: requests.get(f"{server.url}/v2/health/ready", timeout=1).status_code == 200, "the server ready", timeout=120, server=server)
    yield port_of
    stop_server(server)


def test_the_mindie_deployments_args_are_the_servers_and_its_ports_are_theirs():
    from kserve_ascend.server.cli import build_parser

    container = mindie_container()
    args = build_parser().parse_args(container["args"])
    assert args.model_dir == container["volumeMounts"][0]["mountPath"]
    (init,) = mindie("Deployment")["spec"]["template"]["spec"]["initContainers"]
    assert init["args"][1] == args.model_dir  # the storage initializer downloads where the server reads
    assert {port["name"]: port["containerPort"] for port in container["ports"]} == {
        "http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    annotations = mindie("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.metrics_port


@pytest.mark.parametrize("probe", ["livenessProbe", "readinessProbe"])
def test_the_running_server_answers_the_mindie_probes(mindie_server, probe):
    probe = mindie_container()[probe]
    assert probe_action(probe)["path"] in ("/health", "/ready")  # the guide's paths
    assert passes(probe, mindie_server[probe_action(probe)["port"]])


def test_the_running_server_serves_metrics_where_the_pod_annotations_say(mindie_server):
    annotations = mindie("Deployment")["spec"]["template"]["metadata"]["annotations"]
    url = f"http://127.0.0.1:{mindie_server[int(annotations['prometheus.io/port'])]}{annotations['prometheus.io/path']}"
    assert exposed_series(url, "nv_inference_request_success")


def test_the_mindie_deployment_spreads_over_hosts_and_rolls_without_dropping_a_replica():
    deployment, service = mindie("Deployment"), mindie("Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (term,) = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()  # its own replicas repel each other
    assert deployment["spec"]["replicas"] >= 2
    rolling = deployment["spec"]["strategy"]
    assert rolling["type"] == "RollingUpdate" and rolling["rollingUpdate"]["maxUnavailable"] == 0
    assert rolling["rollingUpdate"]["maxSurge"] >= 1  # else a rollout could never start
    named = {port["name"] for port in mindie_container()["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= named
    (grpc,) = [port for port in service["spec"]["ports"] if port["targetPort"] == "grpc"]
    assert grpc["appProtocol"] == "kubernetes.io/h2c"


def test_the_vnpu_overlay_puts_each_replica_on_half_a_310p(kubectl):
    objects = {obj["kind"]: obj for obj in kustomize(kubectl, MINDIE / "vnpu")}
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    limits = container["resources"]["limits"]
    # Ascend's device plugin: a 310P (8 AI cores) cut by the vir04 template is advertised as Ascend310P-4c.
    assert [name for name in limits if name.startswith("huawei.com/")] == ["huawei.com/Ascend310P-4c"]
    assert limits["huawei.com/Ascend310P-4c"] == "1"  # one vNPU per pod
    assert container["image"].endswith("-310p")
    assert pod["nodeSelector"]["node.kubernetes.io/npu.chip.name"].startswith("310P")


# --- /health and /ready --------------------------------------------------------------------


@pytest.fixture(scope="module")
def unready_server(tmp_path_factory):
    """A server that is live but not ready: one of its models cannot load (its file is missing)."""
    repository = tmp_path_factory.mktemp("unready_repo")
    copy_model("simple", repository)
    broken = copy_model("simple", repository, "no_file")
    for file in broken.glob("1/*"):
        file.unlink()
    server = start_server(repository, repository.parent / "unready.log", wait="loaded")
    yield server
    stop_server(server)


@pytest.mark.parametrize("alias, probe", [("/health", "/v2/health/live"), ("/ready", "/v2/health/ready")])
def test_health_and_ready_answer_as_the_oip_probes(unready_server, alias, probe):
    aliased, answered = (requests.get(unready_server.url + path, timeout=5) for path in (alias, probe))
    assert (aliased.status_code, aliased.json()) == (answered.status_code, answered.json())
    assert aliased.status_code == (200 if alias == "/health" else 400)  # live, not ready


# --- Triton's /dev/shm ----------------------------------------------------------------------

#: /dev/shm without a volume there: the container runtime's (Docker's and containerd's default, 64 MiB).
RUNTIME_SHM = 64 * 2**20


def shm_regions(triton_pid: int) -> list[int]:
    """Sizes of the /dev/shm regions of the python backend stubs a Triton process runs, one per model
    instance: a stub's second argument names its region (python_backend src/stub_launcher.cc)."""
    sizes = []
    for process in Path("/proc").iterdir():
        try:
            parent = int((process / "stat").read_text().rpartition(")")[2].split()[1])
            argv = (process / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # not a process, or gone
        if parent == triton_pid and argv[0].endswith(b"/triton_python_backend_stub"):
            sizes.append((Path("/dev/shm") / argv[2].decode()).stat().st_size)
    return sizes


def test_the_triton_pods_shm_holds_a_full_batch_on_every_instance(tmp_path):
    """Triton as the Deployment runs it, each model of the ConfigMap given batches of 1 to
    max_batch_size in turn (as its dynamic batcher forms them while the load rises): the python
    backend's region grows past the runtime's 64 MiB, and the pod's memory volume holds one such
    region per instance."""
    (mount,) = [m for m in triton_container()["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    pod = the(TRITON / "deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v["emptyDir"] for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["medium"] == "Memory"
    configs = {name: text_format.Parse(text, model_config_pb2.ModelConfig()) for name, text in mounted_configs().items()}
    for name, text in mounted_configs().items():
        copy_model(name, tmp_path / "models")
        (tmp_path / "models" / name / "config.pbtxt").write_text(text)
    args = triton_container()["args"]
    triton = start_triton(tmp_path / "models", tmp_path, *args[args.index("--") + 1:])
    try:
        with httpclient.InferenceServerClient(triton.http) as client:
            for name, config in configs.items():
                for batch in range(1, config.max_batch_size + 1):
                    inputs = []
                    for tensor in config.input:
                        assert tensor.data_type == model_config_pb2.TYPE_FP32
                        inputs.append(httpclient.InferInput(tensor.name, [batch, *tensor.dims], "FP32"))
                        inputs[-1].set_data_from_numpy(np.ones((batch, *tensor.dims), np.float32))
                    client.infer(name, inputs)
        regions = shm_regions(triton.process.pid)
    finally:
        stop_server(triton)
    instances = sum(group.count for config in configs.values() for group in config.instance_group)
    assert len(regions) == instances
    # Any instance may be handed such batches.
    assert RUNTIME_SHM < max(regions) and instances * max(regions) <= parse_quantity(volume["sizeLimit"])


# --- Seldon Core 2 -------------------------------------------------------------------------


def test_the_seldon_model_is_placed_on_the_ascend_server(kubectl):
    objects = {obj["kind"]: obj for obj in kustomize(kubectl, SELDON)}
    server, model = objects["Server"]["spec"], objects["Model"]["spec"]
    # Seldon's scheduler places a model on a server whose capabilities cover its requirements;
    # `capabilities` replaces the ServerConfig's list (seldon-core operator, updateCapabilities).
    assert set(model["requirements"]) <= set(server["capabilities"]) == {"ascend"}
    # Merged by name into the ServerConfig's Triton container (named `triton` in Seldon's triton ServerConfig).
    (triton,) = server["podSpec"]["containers"]
    assert triton["name"] == "triton" and server["serverConfig"] == "triton"
    assert triton["resources"]["limits"]["huawei.com/Ascend910"] == "1"
    # The model folder: its name is the Triton model's, its config the `ascend` backend's.
    folder = model["storageUri"].rstrip("/").rsplit("/", 1)[1]
    config = (REPOSITORY / folder / "config.pbtxt").read_text()
    assert f'name: "{folder}"' in config and 'backend: "ascend"' in config


def test_the_seldon_server_leaves_dev_shm_to_its_server_config(kubectl):
    # The triton ServerConfig mounts its own memory volume, `dshm`, at /dev/shm, and Seldon appends a
    # Server's volumes and mounts to the ServerConfig's (seldon-core operator, mergePodSpecs:
    # mergo.WithAppendSlice): declared again here, the pod would be refused.
    (server,) = [obj["spec"] for obj in kustomize(kubectl, SELDON) if obj["kind"] == "Server"]
    assert "volumes" not in server["podSpec"]
    for container in server["podSpec"]["containers"]:
        assert "/dev/shm" not in {mount["mountPath"] for mount in container.get("volumeMounts", [])}


# --- Many models on one NPU (issue 30) -------------------------------------------------------------

MANY_MODELS = MANIFESTS / "examples" / "many-models"


def test_the_many_models_runtime_loads_on_demand_within_its_budget(kubectl, tmp_path):
    """The runtime's own args (model_dir and ports substituted) on models the budget holds two of: none is loaded
    at start, each loads when asked for, and the third unloads the one used least recently."""
    from kserve_ascend.server.cli import build_parser

    (runtime,) = [obj for obj in kustomize(kubectl, MANY_MODELS) if obj["kind"] == "ClusterServingRuntime"]
    assert runtime["metadata"]["name"] == "kserve-ascend-many-models"
    (container,) = runtime["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.load_on_demand and args.memory_budget_mb == 49152
    repository = tmp_path / "mnt_models"
    for name in ("a", "b", "c"):
        copy_model("sim", repository, name)
        config = repository / name / "config.pbtxt"  # 20 GB each, as the ledger counts them (nothing allocated)
        config.write_text(config.read_text() + 'parameters { key: "memory_mb" value: { string_value: "20480" } }\n')
    placed = ("--model_dir", "--http_port", "--grpc_port", "--metrics_port")  # start_server gives its own
    assert set(placed) <= set(flag_values(container["args"]))
    given = [arg for arg in container["args"] if arg.partition("=")[0] not in placed]
    server = start_server(repository, tmp_path / "server.log", *given)
    try:
        index = requests.post(f"{server.url}/v2/repository/index", timeout=5).json()
        assert {e["name"]: e["state"] for e in index} == {"a": "UNAVAILABLE", "b": "UNAVAILABLE", "c": "UNAVAILABLE"}
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
        for name in ("a", "b", "c"):
            answer = requests.post(f"{server.url}/v2/models/{name}/infer", json=body, timeout=30)
            assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [1, 2, 3, 4]
        index = requests.post(f"{server.url}/v2/repository/index", timeout=5).json()
        assert {e["name"] for e in index if e["state"] == "READY"} == {"b", "c"}
        metrics = requests.get(f"{server.url}/metrics", timeout=5).text
        assert 'ascend_device_memory_budget_bytes{device="0"} 5.1539607552e+10' in metrics
        assert 'ascend_model_evictions{model="a"} 1.0' in metrics
    finally:
        stop_server(server)
