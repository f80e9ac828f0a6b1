"""Custom resources checked against their CustomResourceDefinition, as the API server checks them.

The API server validates a custom resource against the `openAPIV3Schema` of the version it is
sent as, after *pruning* every field that schema does not name
(https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/#field-pruning).
Here a pruned field is an error instead: a field the API server would drop silently is a field
the manifest believes it sets (a misspelled `minReplica`, a field of a newer release).

The structural-schema extensions are honoured as the API server honours them:
`x-kubernetes-preserve-unknown-fields` (nothing under it is pruned), `x-kubernetes-int-or-string`
(an integer or a string), `nullable`, `x-kubernetes-list-type: set|map` (no duplicate item, no two
items with the same keys), the `int32`/`int64` formats. `metadata` is checked as the ObjectMeta of
Kubernetes' API schema (kubernetes-validate's strict definitions). Not evaluated: CEL rules
(`x-kubernetes-validations`). A CRD using `x-kubernetes-embedded-resource` is refused rather than
checked wrongly: none of the vendored ones does.
"""

from __future__ import annotations

import importlib.resources
import json
from functools import cache
from pathlib import Path

import jsonschema
import yaml
from referencing import Registry, Resource

CRDS = Path(__file__).resolve().parent / "crds"
KUBERNETES_VERSION = "1.31"  # the oldest Kubernetes the manifests are meant for (as in test_manifests.py)

_DEFINITIONS = "https://kubernetes.io/api/_definitions.json"
_OBJECT_META = {"$ref": f"{_DEFINITIONS}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_UNSUPPORTED = "x-kubernetes-embedded-resource"


class UnknownKind(LookupError):
    pass


def structural(node: dict) -> dict:
    """The JSON Schema (2020-12) that accepts what the API server keeps and validates of `node`."""
    if node.get(_UNSUPPORTED):
        raise NotImplementedError(f"{_UNSUPPORTED} is not supported by this validator")
    schema = {key: value for key, value in node.items() if key not in ("description", "default", "x-kubernetes-validations")}
    if schema.pop("x-kubernetes-int-or-string", False):
        schema.pop("type", None)
        schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]  # `pattern` applies to the string only
    if schema.pop("nullable", False) and "type" in schema:
        schema["type"] = [schema["type"], "null"]
    # Fields are declared by properties, items and additionalProperties only: allOf, anyOf, oneOf
    # and not of a structural schema validate values and declare nothing, so they are kept as they are.
    if "properties" in schema:
        schema["properties"] = {name: structural(child) for name, child in schema["properties"].items()}
    for keyword in ("items", "additionalProperties"):
        if isinstance(schema.get(keyword), dict):
            schema[keyword] = structural(schema[keyword])
    if schema.pop("x-kubernetes-preserve-unknown-fields", False):
        return schema
    if schema.get("type") in ("object", ["object", "null"]) and "additionalProperties" not in schema:
        schema["additionalProperties"] = False  # pruned by the API server: refused here
    return schema


def _list_type(validator, list_type, instance, schema):
    """`x-kubernetes-list-type`: `set` items are unique, `map` items unique by their keys."""
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        seen = [json.dumps(item, sort_keys=True) for item in instance]
        if len(set(seen)) != len(seen):
            yield jsonschema.ValidationError(f"duplicate items in a list of type set: {instance!r}")
    elif list_type == "map":
        keys = [tuple(item.get(key) for key in schema.get("x-kubernetes-list-map-keys", [])) for item in instance]
        duplicates = sorted({key for key in keys if keys.count(key) > 1}, key=repr)
        if duplicates:
            yield jsonschema.ValidationError(f"duplicate keys {duplicates} in a list of type map")


_FORMATS = jsonschema.FormatChecker(formats=())
for _name, (_low, _high) in _INT_RANGES.items():
    _FORMATS.checks(_name)(lambda value, low=_low, high=_high: not isinstance(value, int) or low <= value <= high)

_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"x-kubernetes-list-type": _list_type})


@cache
def _definitions_document() -> dict:
    schemas = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    (directory,) = [d for d in schemas.iterdir() if d.name == f"v{KUBERNETES_VERSION}.0-local-strict"]
    return json.loads((directory / "_definitions.json").read_text())


def kubernetes_definition(name: str) -> dict:
    """The JSON Schema of one of Kubernetes' API types (kubernetes-validate's), by its OpenAPI name
    (`io.k8s.api.core.v1.PodSpec`) or a `$ref` to it: which fields are structs, maps, lists or scalars."""
    return _definitions_document()["$defs"][name.rpartition("/")[2]]


@cache
def _registry() -> Registry:
    return Registry().with_resource(_DEFINITIONS, Resource.from_contents(_definitions_document()))


@cache
def _validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator, for every served version of every CRD in tests/crds."""
    validators = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if not version["served"]:
                continue
            schema = structural(version["schema"]["openAPIV3Schema"])
            # The API server owns these three: kind and apiVersion are strings, metadata is ObjectMeta.
            schema["properties"] |= {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": _OBJECT_META}
            validators[(f"{group}/{version['name']}", kind)] = _Validator(schema, registry=_registry(), format_checker=_FORMATS)
    return validators


def kinds() -> set[tuple[str, str]]:
    """(apiVersion, kind) of every custom resource the vendored CRDs serve."""
    return set(_validators())


def validate(obj: dict) -> None:
    """Raises jsonschema.ValidationError (the first error, with its path) unless the API server would
    take `obj` unpruned; UnknownKind if no vendored CRD serves its apiVersion and kind."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    validator = _validators().get(key)
    if validator is None:
        raise UnknownKind(f"no CRD in {CRDS} serves {key}")
    error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if error is not None:
        raise error
