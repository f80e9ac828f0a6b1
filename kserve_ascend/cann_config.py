"""`--config config.yaml`: the CANN inference server's configuration, served as a model repository.

    server: {http_port, grpc_port, metrics_port}
    models: [{name, version, model_path, input_shape, device_id,
              dynamic_batching: {max_batch_size, max_delay_ms}}, ...]

The file is translated, not interpreted: each model name becomes a Triton-layout
repository model (a config.pbtxt, and version directories linked to the folders of
the `model_path`s) in a private temporary directory, which the server then reads as it
reads any repository. So the two front doors cannot drift apart.
"""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
import typing
from pathlib import Path
from typing import Annotated

import yaml
from google.protobuf import text_format
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from tritonclient.grpc import model_config_pb2 as mc

from .core.config import CONFIG_FILE

#: Model files the yaml may name: those whose tensors the runtime reads from the file
#: (a `.sim` model needs them declared in config.pbtxt, which the yaml has no keys for).
MODEL_SUFFIXES = (".onnx", ".om")
#: Errors this module words itself (pydantic's own get the offending value appended).
_OWN_ERROR = "cann_config"
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


class ConfigError(ValueError):
    """The file is not a valid config.yaml; the message names each bad place in it."""


class _Section(BaseModel):
    # A misspelt key silently ignored is worse than a refusal; YAML's types are taken as
    # they are (the string "8" is not a batch size, `yes` is not a device id).
    model_config = ConfigDict(extra="forbid", strict=True)


Port = Annotated[int, Field(ge=1, le=65535)]


class Server(_Section):
    http_port: Port | None = None
    grpc_port: Port | None = None
    #: 0: /metrics only on the HTTP port, as the flag.
    metrics_port: Annotated[int, Field(ge=0, le=65535)] | None = None


class DynamicBatching(_Section):
    max_batch_size: Annotated[int, Field(ge=1)]
    max_delay_ms: Annotated[float, Field(ge=0)] = 0


class ModelEntry(_Section):
    """One version of a model."""

    name: str
    version: Annotated[int, Field(ge=1)] = 1
    model_path: Annotated[Path, Field(strict=False)]
    input_shape: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)] | None = None
    device_id: Annotated[int, Field(ge=0)] = 0
    dynamic_batching: DynamicBatching | None = None

    @field_validator("name")
    @classmethod
    def _directory_name(cls, name: str) -> str:
        """The name is a directory of the repository, and what clients call the model on the wire."""
        if not _NAME.fullmatch(name):
            message = "must be letters, digits, '_', '-' or '.', not starting with '.', got '{name}'"
            raise PydanticCustomError(_OWN_ERROR, message, {"name": name})
        return name

    @field_validator("model_path")
    @classmethod
    def _model_file(cls, path: Path, info: ValidationInfo) -> Path:
        """Resolved against the yaml file's folder; the file must exist and have a runtime."""
        if path.suffix not in MODEL_SUFFIXES:
            raise PydanticCustomError(_OWN_ERROR, "must be an .onnx or .om file, got '{path}'", {"path": str(path)})
        path = (info.context["folder"] / path).absolute()
        if not path.is_file():
            raise PydanticCustomError(_OWN_ERROR, "no such file {path}", {"path": str(path)})
        return path


class CannConfig(_Section):
    server: Server = Server()
    models: Annotated[list[ModelEntry], Field(min_length=1)]

    def by_name(self) -> dict[str, list[ModelEntry]]:
        """The entries of each model: its versions."""
        models: dict[str, list[ModelEntry]] = {}
        for entry in self.models:
            models.setdefault(entry.name, []).append(entry)
        return models


def load(path: Path) -> CannConfig:
    """Parses and checks a config.yaml; raises ConfigError naming every bad place."""
    try:
        with open(path, "rb") as file:
            data = yaml.safe_load(file)
    except OSError as error:
        raise ConfigError(f"cannot read it: {error.strerror}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"not valid YAML: {where}{getattr(error, 'problem', None) or error}") from None
    try:
        config = CannConfig.model_validate(data, context={"folder": Path(path).parent})
    except ValidationError as error:
        raise ConfigError("; ".join(_describe(e) for e in error.errors(include_url=False))) from None
    problems = _versions_problems(config)
    if problems:
        raise ConfigError("; ".join(problems))
    return config


def _versions_problems(config: CannConfig) -> list[str]:
    """Entries of one name are the versions of one model: distinct, and alike in all but file."""
    problems: list[str] = []
    first: dict[str, int] = {}
    seen: dict[tuple[str, int], int] = {}
    for i, entry in enumerate(config.models):
        other = seen.setdefault((entry.name, entry.version), i)
        if other != i:
            problems.append(f"models[{i}]: duplicates models[{other}] (name {entry.name!r}, version {entry.version})")
            continue
        j = first.setdefault(entry.name, i)
        model = config.models[j]
        for key in ("input_shape", "device_id", "dynamic_batching"):
            if getattr(entry, key) != getattr(model, key):
                problems.append(
                    f"models[{i}].{key}: differs from models[{j}], another version of {entry.name!r}"
                    " (the versions of one model share its config)"
                )
        if entry.model_path.name != model.model_path.name:
            problems.append(
                f"models[{i}].model_path: file name {entry.model_path.name!r} differs from {model.model_path.name!r}"
                f" of models[{j}], another version of {entry.name!r} (one default_model_filename per model)"
            )
    return problems


def _describe(error: dict) -> str:
    """One pydantic error as `place: what is wrong`, in the yaml's own terms."""
    loc, kind = error["loc"], error["type"]
    if kind == "extra_forbidden":
        expected = ", ".join(_section_at(loc[:-1]).model_fields)
        return f"{_place(loc[:-1])}: unknown key {loc[-1]!r} (expected: {expected})"
    if kind == "missing":
        return f"{_place(loc[:-1])}: missing key {loc[-1]!r}"
    if kind == "model_type":  # pydantic's wording names the Python class
        expected = ", ".join(_section_at(loc).model_fields)
        return f"{_place(loc)}: must be a mapping with keys {expected}, got {error['input']!r}"
    if kind == _OWN_ERROR:
        return f"{_place(loc)}: {error['msg']}"
    message = error["msg"][0].lower() + error["msg"][1:]
    return f"{_place(loc)}: {message}, got {error['input']!r}"


def _place(loc: tuple) -> str:
    """`models[1].dynamic_batching.max_delay_ms` for pydantic's ('models', 1, 'dynamic_batching', 'max_delay_ms')."""
    place = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    return place or "top level"


def _section_at(loc: tuple) -> type[BaseModel]:
    """The schema class of the mapping at `loc`, to list the keys it takes."""
    section: type[BaseModel] = CannConfig
    for part in loc:
        if isinstance(part, str):
            section = _section_in(section.model_fields[part].annotation)
    return section


def _section_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):  # list[ModelEntry], DynamicBatching | None
        if (section := _section_in(argument)) is not None:
            return section
    return None


def model_config(versions: list[ModelEntry]) -> mc.ModelConfig:
    """The config.pbtxt of one model; inputs and outputs are left to auto-completion from the file."""
    entry = versions[0]
    config = mc.ModelConfig(name=entry.name, backend="ascend", default_model_filename=entry.model_path.name)
    config.version_policy.specific.versions.extend(sorted(v.version for v in versions))
    config.parameters["device_ids"].string_value = str(entry.device_id)
    if entry.input_shape:
        config.parameters["input_shape"].string_value = ",".join(map(str, entry.input_shape))
    if entry.dynamic_batching:
        config.max_batch_size = entry.dynamic_batching.max_batch_size
        config.dynamic_batching.SetInParent()  # present even with no delay: batching is on
        config.dynamic_batching.max_queue_delay_microseconds = round(entry.dynamic_batching.max_delay_ms * 1000)
    return config


def write_repository(config: CannConfig, root: Path, source: Path | None = None) -> None:
    """Lays out `config` under `root` in Triton's layout.

    A version directory is a link to the folder holding its model file, not a link to
    the file: runtimes find what sits beside the model (ONNX external data) there.
    """
    header = f"# Generated from {source} by kserve-ascend --config.\n" if source else ""
    for name, versions in config.by_name().items():
        model_dir = root / name
        model_dir.mkdir()
        for entry in versions:
            (model_dir / str(entry.version)).symlink_to(entry.model_path.parent, target_is_directory=True)
        (model_dir / CONFIG_FILE).write_text(header + text_format.MessageToString(model_config(versions)))


def parser_defaults(path: Path) -> dict:
    """The flags a config.yaml sets: `model_dir` (its models as a repository) and the ports it gives.

    A bad file ends the process with the message (no traceback). The repository lives in a
    private temporary directory removed at exit (its links only: the models stay).
    """
    try:
        config = load(path)
    except ConfigError as error:
        raise SystemExit(f"kserve-ascend: {path}: {error}") from None
    root = Path(tempfile.mkdtemp(prefix="kserve-ascend-config-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    write_repository(config, root, Path(path).absolute())
    return {"model_dir": str(root), **config.server.model_dump(exclude_none=True)}
