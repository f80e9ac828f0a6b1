"""The pod Seldon Core 2 runs for a Server: its ServerConfig's pod spec with the Server's merged in,
as Seldon's operator merges them.

Seldon (operator/controllers/reconcilers/server/server_reconciler.go, mergePodSpecs and
mergeContainers, v2.6.0-v2.7.x; operator/controllers/reconcilers/common/patch_utils.go,
MergePodSpecs and MergeContainers, v2.8.0-v2.10.2, the same code):

    dst := serverConfigPodSpec.DeepCopy()
    mergo.Merge(dst, serverPodSpec, mergo.WithOverride, mergo.WithAppendSlice)
    dst.Containers = MergeContainers(serverConfigPodSpec.Containers, serverPodSpec.Containers)

MergeContainers merges each of the Server's containers into the ServerConfig's container of the same
name with the same mergo.Merge call (a container of a new name is added as it is), Server's first,
then the ServerConfig's other containers. Then updateCapabilities sets the agent's
SELDON_SERVER_CAPABILITIES to the Server's `capabilities` (server_reconciler.go).

mergo (imdario/mergo v0.3.12 in Seldon 2.6-2.7, v0.3.16 in 2.8, dario.cat/mergo v1.0.0 from 2.9;
merge.go, deepMerge: the same rules for these two options in all three) walks the Go values:
- a struct: field by field; a pointer: nil in src keeps dst's, nil in dst takes src's, both set
  merges what they point to, field by field (so a Server's `preStop: exec` joins a ServerConfig's
  `preStop: httpGet` in one handler);
- a map: every key of src is set in dst (its value replaced: PodSpec's maps hold strings and
  resource.Quantities);
- a slice: src's items appended to dst's (WithAppendSlice), whatever either holds;
- any other value: src's, unless it is its type's zero value (false, 0, ""): WithOverride overrides
  only with non-empty values.
Two API types are structs with their own fields in Go although they are scalars on the wire:
intstr.IntOrString ({Type, IntVal, StrVal}, merged field by field) and resource.Quantity (whose only
exported field is Format: merged as a struct field, dst's amount stays; as a map value, replaced).
Which fields are structs, maps, lists or scalars is read from Kubernetes' OpenAPI definitions.
"""

from __future__ import annotations

import copy

from crd_schema import kubernetes_definition

POD_SPEC = "io.k8s.api.core.v1.PodSpec"
CONTAINER = "io.k8s.api.core.v1.Container"
_INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
_QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
#: seldon-core operator/controllers/reconcilers/server/server_reconciler.go, EnvVarNameCapabilities.
CAPABILITIES_ENV = "SELDON_SERVER_CAPABILITIES"


def _zero(value) -> bool:
    """mergo's isEmptyValue of a scalar: its Go type's zero value."""
    return value is None or (not isinstance(value, (dict, list)) and value in (False, 0, ""))


def _int_or_string(dst, src):
    """intstr.IntOrString{Type, IntVal, StrVal} merged field by field: each of src's fields wins unless
    zero, and Type says which value the result is (a Server's port 9000 over a ServerConfig's port
    "http" stays "http")."""

    def fields(value):
        return (1, 0, value) if isinstance(value, str) else (0, value, "")

    merged = [s if not _zero(s) else d for d, s in zip(fields(dst), fields(src))]
    kind, number, name = merged
    return name if kind == 1 else number


def merge(dst, src, schema: dict):
    """mergo.Merge(&dst, src, WithOverride, WithAppendSlice) on values of the API type `schema` names."""
    name = schema.get("$ref", "").rpartition("/")[2]
    if name == _INT_OR_STRING:
        return _int_or_string(dst, src)
    if name == _QUANTITY:
        return dst  # a struct whose only exported field is Format: the amount stays dst's
    definition = kubernetes_definition(name) if name else schema
    if "properties" in definition:  # a struct, or a pointer to one
        merged = dict(dst)
        for key, value in src.items():
            if value is None:
                continue  # a nil pointer (or absent value) in src: dst's stays
            merged[key] = value if dst.get(key) is None else merge(dst[key], value, definition["properties"][key])
        return merged
    if "additionalProperties" in definition:  # a map: src's keys replace dst's
        assert not any(isinstance(value, (dict, list)) for value in src.values()), "map of structs: not modelled"
        return {**dst, **src}
    if "items" in definition:  # a slice: appended
        return [*dst, *src]
    return dst if _zero(src) else src


def merge_containers(existing: list[dict], overrides: list[dict]) -> list[dict]:
    """Seldon's MergeContainers: each override merged into the existing container of its name (or
    added), then the existing containers no override names."""
    container = {"$ref": CONTAINER}
    merged = []
    for override in overrides:
        same = [merge(mine, override, container) for mine in existing if mine["name"] == override["name"]]
        merged += same or [override]
    named = {override["name"] for override in overrides}
    return merged + [mine for mine in existing if mine["name"] not in named]


def server_pod(server_config: dict, server: dict) -> dict:
    """The pod spec of the StatefulSet Seldon makes for `server` of `server_config` (both objects as applied)."""
    config_pod = copy.deepcopy(server_config["spec"]["podSpec"])
    server_pod_spec = server["spec"].get("podSpec")
    if server_pod_spec is None:
        return config_pod
    pod = merge(config_pod, server_pod_spec, {"$ref": POD_SPEC})
    pod["containers"] = merge_containers(config_pod["containers"], server_pod_spec.get("containers", []))
    capabilities = server["spec"].get("capabilities", [])
    for env in (env for container in pod["containers"] for env in container.get("env", [])):
        if capabilities and env["name"] == CAPABILITIES_ENV:
            env["value"] = ",".join(capabilities)
    return pod


def statefulset(server_config: dict, server: dict) -> dict:
    """The StatefulSet Seldon makes for `server` (seldon-core operator/controllers/reconcilers/server/
    statefulset_reconciler.go, toStatefulSet; labels from operator/pkg/constants)."""
    name = server["metadata"]["name"]
    labels = {"app": "seldon-server"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "serviceName": name,
            "replicas": server["spec"].get("replicas", 1),
            "selector": {"matchLabels": {"seldon-server-name": name}},
            "template": {"metadata": {"name": name, "labels": {"seldon-server-name": name, **labels}},
                         "spec": server_pod(server_config, server)},
            "podManagementPolicy": "Parallel",
            "volumeClaimTemplates": [{"metadata": {"name": claim["name"]}, "spec": claim["spec"]}
                                     for claim in server_config["spec"].get("volumeClaimTemplates", [])],
        },
    }
