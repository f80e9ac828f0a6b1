"""config.pbtxt: parsing with Triton's own ModelConfig protobuf, version selection, model files."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor, json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from .errors import InvalidInput, ModelLoadError

CONFIG_FILE = "config.pbtxt"
#: Looked for in this order in a version directory when config.pbtxt names no file.
DEFAULT_FILENAMES = ("model.onnx", "model.om", "model.sim")
#: Runtimes of the core's own code (runtimes/yolo.py, runtimes/repeat.py): they load no file, so a version
#: of their model is its directory, which both servers require to exist, and nothing in it.
PROCESSING_RUNTIMES = frozenset({"yolov8_preprocess", "yolov8_postprocess", "repeat"})


def read_config(model_dir: Path) -> mc.ModelConfig:
    """Parses `<model_dir>/config.pbtxt`; a missing file is an empty config to be auto-completed."""
    path = model_dir / CONFIG_FILE
    config = mc.ModelConfig()
    if path.exists():
        try:
            text_format.Parse(path.read_text(), config)
        except (text_format.ParseError, UnicodeDecodeError) as error:
            raise ModelLoadError(f"{CONFIG_FILE} is not a valid ModelConfig: {error}") from None
    if not config.name:
        config.name = model_dir.name
    elif config.name != model_dir.name:
        # Triton refuses this too: the directory name is the model's name on the wire.
        raise ModelLoadError(
            f"{CONFIG_FILE} names the model '{config.name}' but its directory is '{model_dir.name}'"
        )
    return config


def check_supported(config: mc.ModelConfig) -> None:
    """Refuses, naming the field, a config asking for what the ascend backend does not do, rather
    than serving it as if it had not asked."""
    if config.response_cache.enable:
        # Triton's refusals, word for word (core's ValidateModelConfig, model_config_utils.cc), whether or not
        # the server has a cache: the cache stores one answer per request, which neither kind of model has.
        if config.HasField("sequence_batching"):
            raise ModelLoadError(
                f"Response Cache does not currently support model {config.name} with sequence batching scheduler."
                " Please disable the response cache."
            )
        if config.model_transaction_policy.decoupled:
            raise ModelLoadError(
                f"Response Cache does not currently support model {config.name} with 'decoupled' transaction policy."
                " Please disable the response cache."
            )
    # A decoupled model answers a request with zero or more responses (scheduling.decoupled), one request per
    # execution: neither the sequence batcher nor an ensemble's steps take a stream of responses.
    if config.model_transaction_policy.decoupled and config.HasField("sequence_batching"):
        raise ModelLoadError(
            "model_transaction_policy.decoupled is not supported with sequence_batching: a decoupled model"
            " answers each request on its own"
        )


def available_versions(model_dir: Path) -> list[int]:
    """Version directories present on disk (numeric names), ascending."""
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def select_versions(config: mc.ModelConfig, available: list[int]) -> list[int]:
    """The versions to serve under `version_policy` (default: the latest one), ascending."""
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        selected = list(available)
    elif choice == "specific":
        missing = sorted(set(policy.specific.versions) - set(available))
        if missing:
            raise ModelLoadError(f"version_policy names versions {missing} that have no directory")
        selected = sorted(set(policy.specific.versions))
    else:
        count = policy.latest.num_versions if choice == "latest" else 1
        selected = available[-max(count, 1):]
    if not selected:
        raise ModelLoadError("no version directory (e.g. '1/') holds a model")
    return selected


_MAX_VERSION = 2**63 - 1  # Triton's versions are int64


def parse_version(version: str | None) -> int | None:
    """The version number a request names (None: it names none); InvalidInput unless it is a number.

    Triton's wording (GetModelVersionFromString, server's common.cc), which is INVALID_ARGUMENT
    there too; "0" is a number, of a version no repository has.
    """
    if not version:
        return None
    if not (version.isascii() and version.isdigit()) or int(version) > _MAX_VERSION:
        raise InvalidInput(
            f"failed to get model version from specified version string '{version[:100]}', "
            "version should be an integral value > 0"
        )
    return int(version)


def model_file(config: mc.ModelConfig, version_dir: Path) -> Path:
    """The model file of one version: `default_model_filename`, else the first default present
    (for a processing runtime, the version directory itself)."""
    if _string_parameter(config, "runtime") in PROCESSING_RUNTIMES:
        if not version_dir.is_dir():
            raise ModelLoadError(f"version {version_dir.name} has no directory")
        return version_dir
    names = (config.default_model_filename,) if config.default_model_filename else DEFAULT_FILENAMES
    for name in names:
        if (version_dir / name).is_file():
            return version_dir / name
    raise ModelLoadError(f"version {version_dir.name} has no model file (looked for {', '.join(names)})")


#: The backend and platform Triton's auto-complete gives a config naming neither, by the model file it finds
#: (core src/model_config_utils.cc, AutoCompleteBackendFields): of this server's files, only an ONNX one has one.
TRITON_AUTO_BACKENDS = {"model.onnx": ("onnxruntime", "onnxruntime_onnx")}


def complete_backend(config: mc.ModelConfig, path: Path) -> None:
    """Names the backend of a config that names neither backend nor platform: Triton's for the file (and its
    platform and default_model_filename, as Triton fills them in), else `ascend`, the backend serving it."""
    if config.backend or config.platform:
        return
    if path.name in TRITON_AUTO_BACKENDS:
        config.backend, config.platform = TRITON_AUTO_BACKENDS[path.name]
        config.default_model_filename = config.default_model_filename or path.name
    else:
        config.backend = "ascend"


def triton_needs(read: mc.ModelConfig, served: mc.ModelConfig) -> str:
    """What a Triton deployment needs to serve a model as this server does, "" when nothing: `read` is the
    config as config.pbtxt says it, `served` the one completed from the file (complete_backend)."""
    if read.backend or read.platform:
        return ""
    if served.backend == "ascend":
        return ("config.pbtxt names no backend, and Triton's auto-complete names one only for a model.onnx:"
                ' under Triton this model needs a config.pbtxt with backend: "ascend"')
    return (f"config.pbtxt names no backend: served as backend '{served.backend}', which Triton's auto-complete"
            " names; Triton serves it with the ascend backend where that is installed under this name too"
            ' (make triton and the kserve-ascend-triton image do), elsewhere it needs config.pbtxt with backend: "ascend"')


def model_devices(config: mc.ModelConfig) -> list[int]:
    """The NPUs the model is given: the `device_ids` parameter ("0,1"), the CANN way of binding
    models to NPU cores; NPU 0 if it names none."""
    param = config.parameters.get("device_ids")
    try:
        return [int(d) for d in param.string_value.split(",")] if param else [0]
    except ValueError:
        raise ModelLoadError(f"parameter device_ids must be comma-separated integers, got {param.string_value!r}") from None


def group_devices(group: mc.ModelInstanceGroup, devices: list[int]) -> list[int]:
    """The NPUs on each of which `group` runs `count` instances, as Triton reads `gpus` with NPUs for
    GPUs: those it lists; for KIND_GPU listing none, every NPU of the model (`devices`), as Triton
    takes every visible GPU. Empty for a group the server places itself (see `device_placement`)."""
    if group.gpus:
        return list(group.gpus)
    return list(devices) if group.kind == mc.ModelInstanceGroup.KIND_GPU else []


#: Backends whose CPU groups Triton gives two instances by default (core's SetDefaultInstanceCount, model_config_utils.cc).
TWO_CPU_INSTANCE_BACKENDS = frozenset({"onnxruntime", "tensorflow"})


def instance_count(config: mc.ModelConfig, group: mc.ModelInstanceGroup) -> int:
    """A group's instances: its `count`, else Triton's default, 2 for a CPU group of the backends above (and a group
    without kind or `gpus`, which Triton makes KIND_CPU where it finds no GPU, as on every Ascend host), else 1."""
    if group.count > 0:
        return group.count
    cpu = group.kind == mc.ModelInstanceGroup.KIND_CPU or (group.kind == mc.ModelInstanceGroup.KIND_AUTO and not group.gpus)
    return 2 if cpu and config.backend in TWO_CPU_INSTANCE_BACKENDS else 1


def triton_refusals(config: mc.ModelConfig) -> str:
    """What Triton 2.51 refuses of the config's instance groups on a host without NVIDIA GPUs (every Ascend host), in
    its words (core's ValidateInstanceGroup, model_config_utils.cc), which this server serves (KIND_GPU and `gpus` as
    NPUs); "" when nothing."""
    refused = []
    for index, group in enumerate(config.instance_group):
        name = group.name or f"{config.name}_{index}"
        kind = mc.ModelInstanceGroup.Kind.Name(group.kind) if group.kind != mc.ModelInstanceGroup.KIND_AUTO else "KIND_CPU"
        if group.kind == mc.ModelInstanceGroup.KIND_GPU and not group.gpus:
            refused.append(f"instance group {name} of model {config.name} has kind KIND_GPU but no GPUs are available")
        elif group.kind == mc.ModelInstanceGroup.KIND_GPU:
            refused.append(f"instance group {name} of model {config.name} specifies invalid or unsupported gpu id {group.gpus[0]}")
        elif group.gpus:
            refused.append(f"instance group {name} of model {config.name} has kind {kind} but specifies one or more GPUs")
    if not refused:
        return ""
    return ("Triton refuses it where it finds no NVIDIA GPU, as on every Ascend host: " + "; ".join(refused)
            + ' (use KIND_MODEL, and the NPUs in parameters { key: "device_ids" })')


def device_placement(config: mc.ModelConfig) -> list[int]:
    """Device id of every instance to create, in order (see `instance_placement`)."""
    return [device for device, _ in instance_placement(config)]


def instance_placement(config: mc.ModelConfig) -> list[tuple[int, mc.ModelInstanceGroup]]:
    """Every instance to create, in order: its device id and its group.

    A group with NPUs (`group_devices`: its `gpus`, or KIND_GPU's default of every NPU in
    `device_ids`) places `count` instances on each of them, as Triton places a KIND_GPU group;
    any other group (KIND_MODEL, KIND_CPU, no kind) has its `count` instances spread
    round-robin over `device_ids`, continuing across groups.
    """
    devices = model_devices(config)
    placement: list[tuple[int, mc.ModelInstanceGroup]] = []
    for group in config.instance_group or [mc.ModelInstanceGroup()]:
        count = instance_count(config, group)
        if on := group_devices(group, devices):
            placement.extend((device, group) for device in on for _ in range(count))
        else:
            start = len(placement)  # round-robin continues across groups
            placement.extend((devices[(start + i) % len(devices)], group) for i in range(count))
    return placement


_INT64 = {descriptor.FieldDescriptor.TYPE_INT64, descriptor.FieldDescriptor.TYPE_UINT64,
          descriptor.FieldDescriptor.TYPE_SINT64, descriptor.FieldDescriptor.TYPE_FIXED64}


def normalized(config: mc.ModelConfig) -> mc.ModelConfig:
    """A copy of the config with the defaults Triton writes in (core's NormalizeModelConfig and
    NormalizeInstanceGroup, model_config_utils.cc) where they mean what this server does.

    `version_policy`: latest 1 (what select_versions serves); `dynamic_batching`'s
    `preferred_batch_size`: [max_batch_size] (the batcher sends a full batch at once either way);
    every `instance_group` named `<model>_<index>` with its count (`instance_count`; one group named
    after the model when there is none), its kind resolved (no kind: KIND_GPU if it lists NPUs,
    else KIND_CPU, placed by this server) and its `gpus` the NPUs it runs on, as
    device_placement creates them (Triton resolves KIND_AUTO and fills a KIND_GPU group's
    `gpus` with every GPU, NormalizeInstanceGroup). Left out, as they
    describe Triton's own machinery: `optimization` (CUDA pinned memory, priorities) and
    `runtime` (the backend's library, `model.py` under Triton's Python backend).
    """
    config = mc.ModelConfig.FromString(config.SerializeToString())
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if config.HasField("dynamic_batching") and not config.dynamic_batching.preferred_batch_size and config.max_batch_size > 0:
        config.dynamic_batching.preferred_batch_size.append(config.max_batch_size)
    if config.platform == "ensemble":
        # No instance of its own, so no instance_group; Triton's ensemble validation writes whether it is
        # decoupled (core's ensemble_utils.cc).
        config.model_transaction_policy.SetInParent()
    elif not config.instance_group:
        config.instance_group.add(name=config.name)
    devices = model_devices(config)
    for index, group in enumerate(config.instance_group):
        group.name = group.name or f"{config.name}_{index}"
        group.count = instance_count(config, group)
        if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
            # As Triton resolves it where it finds no GPU (every Ascend host): KIND_CPU, placed as KIND_MODEL.
            group.kind = mc.ModelInstanceGroup.KIND_GPU if group.gpus else mc.ModelInstanceGroup.KIND_CPU
        group.gpus[:] = group_devices(group, devices)
    return config


def config_json(config: mc.ModelConfig) -> dict:
    """The config as JSON the way Triton's model configuration extension writes it.

    As Triton's (protobuf's JSON printer with always_print_primitive_fields): every field
    without presence is written, at its default too (`max_batch_size: 0`, empty lists and
    maps), enums by name, the defaults of `normalized` filled in. protobuf's JSON mapping
    writes 64-bit integers (dims, delays) as strings; Triton writes them as numbers, and so
    does this.
    """
    config = normalized(config)
    as_dict = json_format.MessageToDict(config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if "ensemble_scheduling" in as_dict and not config.ensemble_scheduling.max_inflight_requests:
        # Newer than Triton 2.51's ModelConfig (tritonclient's protobuf has it): written only when set.
        del as_dict["ensemble_scheduling"]["max_inflight_requests"]
    return _int64_as_numbers(config, as_dict)


def _int64_as_numbers(message, value):
    for field in message.DESCRIPTOR.fields:
        if field.name not in value:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                for key, item in getattr(message, field.name).items():
                    _int64_as_numbers(item, value[field.name][str(key)])
        elif field.message_type is not None:
            items = getattr(message, field.name)
            if field.is_repeated:
                for item, item_value in zip(items, value[field.name]):
                    _int64_as_numbers(item, item_value)
            else:
                _int64_as_numbers(items, value[field.name])
        elif field.type in _INT64:
            raw = value[field.name]
            value[field.name] = [int(v) for v in raw] if isinstance(raw, list) else int(raw)
    return value


def _string_parameter(config: mc.ModelConfig, key: str) -> str:
    return config.parameters[key].string_value.strip() if key in config.parameters else ""


#: `execution_timeout_ms` unless the config sets it: far above any batch's execution (a large
#: detector batch on a 310 takes a second), so only a device that stopped answering reaches it.
DEFAULT_EXECUTION_TIMEOUT_MS = 30_000


def execution_timeout_s(config: mc.ModelConfig) -> float:
    """`parameters { key: "execution_timeout_ms" }`: how long one execution may take before the
    instance running it is taken out of rotation (a hung device). Seconds."""
    value = _string_parameter(config, "execution_timeout_ms") or str(DEFAULT_EXECUTION_TIMEOUT_MS)
    try:
        timeout_ms = float(value)
    except ValueError:
        raise ModelLoadError(f"parameter execution_timeout_ms must be a number of milliseconds, got {value!r}") from None
    if timeout_ms <= 0:
        raise ModelLoadError(f"parameter execution_timeout_ms must be positive, got {value!r}")
    return timeout_ms / 1000


def expected_sha256(config: mc.ModelConfig, version: int) -> str | None:
    """The digest `parameters { key: "sha256" }` expects of a version's file, if any.

    The value is one hex digest for every version, or `"1:<hex>,2:<hex>"` per version
    (a version left out is not checked).
    """
    value = _string_parameter(config, "sha256").lower()
    if not value:
        return None
    if ":" not in value:
        return value
    try:
        digests = {int(v): d.strip() for v, d in (item.split(":", 1) for item in value.split(","))}
    except ValueError:
        raise ModelLoadError(f"parameter sha256 must be a hex digest or 'version:digest,...', got {value!r}") from None
    return digests.get(version)


def version_weights(config: mc.ModelConfig) -> dict[int, float]:
    """`parameters { key: "version_weights" value { string_value: "1:90,2:10" } }`: A/B traffic shares.

    Requests that name no version go to the served versions in these proportions.
    """
    value = _string_parameter(config, "version_weights")
    if not value:
        return {}
    try:
        weights = {int(v): float(w) for v, w in (item.split(":", 1) for item in value.split(","))}
    except ValueError:
        raise ModelLoadError(f"parameter version_weights must be 'version:weight,...', got {value!r}") from None
    if any(w < 0 for w in weights.values()) or not sum(weights.values()):
        raise ModelLoadError(f"parameter version_weights needs non-negative weights, not all zero, got {value!r}")
    return weights


def apply_input_shape(config: mc.ModelConfig) -> None:
    """`parameters { key: "input_shape" value { string_value: "1,3,640,640" } }`: every input's shape, batch first.

    The CANN config.yaml declares a shape but names no tensor, so this runs once the
    config is completed from the model file: a fixed dimension must agree, a variable
    one takes the declared size (requests are then held to it). When the model batches,
    the first dimension is the batch, which max_batch_size governs.
    """
    value = _string_parameter(config, "input_shape")
    if not value:
        return
    try:
        shape = [int(d) for d in value.split(",")]
    except ValueError:
        raise ModelLoadError(f"parameter input_shape must be comma-separated integers, got {value!r}") from None
    batch = [-1] if config.max_batch_size > 0 else []
    declared = shape[len(batch):]
    for tensor in config.input:
        dims = list(tensor.dims)
        if len(dims) != len(declared) or any(a != b and -1 not in (a, b) for a, b in zip(dims, declared)):
            raise ModelLoadError(
                f"input_shape {shape} does not fit input '{tensor.name}' of shape {batch + dims} (batch dimension first)"
            )
        tensor.dims[:] = [b if a == -1 else a for a, b in zip(dims, declared)]
