"""The `ascend` Python-based backend: kserve-ascend's executor core inside Triton.

Triton loads this file for every model whose config.pbtxt says `backend: "ascend"`;
the model's version directories hold only the model file (model.onnx, model.om,
model.sim). Triton keeps its own frontends, dynamic batcher and instance groups; this
file only translates between Triton's requests and the core's `Instance`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from kserve_ascend.core import config as cfg
from kserve_ascend.core import heap
from kserve_ascend.core.errors import AscendError, InvalidInput
from kserve_ascend.core.execution import loading
from kserve_ascend.core.execution.instance import complete_config
from kserve_ascend.core.execution.runtimes import load_runtime
from kserve_ascend.core.scheduling.sequences import StateStore

#: The KServe server's `ascend_batch_padding_rows`, here one of Triton's custom metrics.
PADDING_METRIC = "ascend_batch_padding_rows"


def _model_config(config_json: str | dict) -> mc.ModelConfig:
    config = json.loads(config_json) if isinstance(config_json, str) else config_json
    return json_format.ParseDict(config, mc.ModelConfig(), ignore_unknown_fields=True)


def _as_triton_hands_them(config: mc.ModelConfig) -> mc.ModelConfig:
    """The config with each tensor's `reshape` as its dims: the shapes this backend sees.

    Triton reshapes an input to its `reshape` before the backend gets it (core
    src/infer_request.cc), and takes outputs back in their `reshape` shape, turning them into
    `dims` itself (core src/infer_response.cc, InferenceResponse::Output::Reshape).
    """
    model = mc.ModelConfig()
    model.CopyFrom(config)
    for tensor in (*model.input, *model.output):
        if tensor.HasField("reshape"):
            tensor.dims[:] = tensor.reshape.shape
            tensor.ClearField("reshape")
    return model


def _instance_device(config: mc.ModelConfig, args: dict) -> int:
    """The device of this instance: Triton's for KIND_GPU, else its slot in `device_ids` placement.

    Triton names instances `<group name>_<index in group>`; the global index over the
    groups picks the same device the KServe server gives that instance.
    """
    if args["model_instance_kind"] == "GPU":
        return int(args["model_instance_device_id"])
    placement = cfg.device_placement(config)
    name, before = args["model_instance_name"], 0
    for group in config.instance_group:
        prefix = f"{group.name}_"
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return placement[(before + int(name[len(prefix):])) % len(placement)]
        before += group.count or 1
    return placement[0]


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """Fills inputs, outputs and max_batch_size from the model file when config.pbtxt leaves them out.

        Triton hands the config it read (possibly empty); the model file is found in the
        version directory Triton points the stub at (`pb_utils.get_model_dir()`).
        """
        config = _model_config(auto_complete_model_config.as_dict())
        if config.input and config.output:
            return auto_complete_model_config
        model_dir = Path(pb_utils.get_model_dir())
        version_dir = model_dir if model_dir.name.isdigit() else model_dir / str(cfg.available_versions(model_dir)[-1])
        runtime = load_runtime(config, cfg.model_file(config, version_dir), device_id=0)
        try:
            declared_inputs, declared_outputs = len(config.input), len(config.output)
            complete_config(config, runtime)
        finally:
            runtime.close()
        auto_complete_model_config.set_max_batch_size(config.max_batch_size)
        tensors = [(t, auto_complete_model_config.add_input) for t in config.input[declared_inputs:]]
        tensors += [(t, auto_complete_model_config.add_output) for t in config.output[declared_outputs:]]
        for tensor, add in tensors:
            add({"name": tensor.name, "data_type": mc.DataType.Name(tensor.data_type), "dims": list(tensor.dims)})
        return auto_complete_model_config

    def initialize(self, args: dict) -> None:
        """Loads the version's file on this instance's device and warms it up, as the KServe server loads each of
        its instances (`loading.load_instances`); Triton runs a config's `model_warmup` itself once this returns.

        Triton passes `model_config` (JSON), `model_repository` (the model's directory),
        `model_version`, `model_instance_name`, `model_instance_kind` and `model_instance_device_id`.
        """
        config = _as_triton_hands_them(_model_config(args["model_config"]))
        self.outputs = [tensor.name for tensor in config.output]
        # Answers each request with a stream of responses through its response sender (python_backend's
        # decoupled mode), as the KServe server does (scheduling.decoupled).
        self.decoupled = config.model_transaction_policy.decoupled
        device_id = _instance_device(config, args)
        name = args["model_instance_name"]
        try:
            loaded = loading.load_instances(
                config, Path(args["model_repository"]), int(args["model_version"]), [device_id], configured_warmup=False
            )
        except AscendError as error:
            raise _without_traceback(error) from None
        self.instance = loaded.instances[0]
        self.signature, self.prepare_request = loaded.signature, loaded.prepare_request
        # A sequence model also takes the control inputs Triton's sequence batcher adds, and implicit
        # state, which this backend keeps (Triton's python backend cannot).
        self.states = StateStore(loaded.sequences) if loaded.sequences is not None else None
        runtime = self.instance.runtime
        try:
            description = ", ".join(f"{k} {v}" for k, v in self.instance.parameters.items())
            pb_utils.Logger.log_info(
                f"{name}: {runtime.path.name} with runtime {runtime.name} on device {device_id}"
                + (f" ({description})" if description else "")
            )
            if loaded.samples:
                warmup_ms = loading.warm_up(self.instance, loaded.samples, f"device {device_id}")
                pb_utils.Logger.log_info(f"{name}: warmed up in {warmup_ms:.0f} ms ({len(loaded.samples)} samples)")
        except AscendError as error:
            loaded.close()
            raise _without_traceback(error) from None
        # The family outlives its metric (the stub refuses the other order).
        self.padding_family = pb_utils.MetricFamily(
            name=PADDING_METRIC,
            description="Zero rows added to batches to reach a batch size the model file takes",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.padding = self.padding_family.Metric(labels={"model": args["model_name"], "version": args["model_version"]})
        heap.settle(f"{name} loaded")  # the stub is this instance's own process

    def _accepted(self, request) -> dict:
        """The request's inputs as the instance takes them; InvalidInput if they do not fit the model."""
        inputs = {}
        for name in self.signature.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        if self.states is not None:
            inputs.update(self.states.inputs(request.correlation_id(), request.flags()))
        parameters = json.loads(request.parameters() or "{}") if self.prepare_request is not None else {}
        return loading.accept(self.signature, self.prepare_request, inputs, parameters)[1]

    def _wanted(self, request) -> list[str]:
        # Triton's order is the order the backend returns them in. The stub gives the requested names
        # as a set (python_backend src/infer_request.cc: std::set), so the config's order it is.
        requested = request.requested_output_names()
        return [n for n in self.outputs if n in requested] if requested else self.outputs

    def execute(self, requests: list) -> list | None:
        """Runs the requests Triton's batcher gathered as one batch; a bad request fails alone. A decoupled
        model answers each through its response sender instead (and returns None, as python_backend requires)."""
        if self.decoupled:
            for request in requests:
                self._stream(request)
            return None
        responses: list = [None] * len(requests)
        batch, positions, wanted = [], [], []
        for position, request in enumerate(requests):
            try:
                inputs = self._accepted(request)
            except InvalidInput as error:
                responses[position] = _error(error)
                continue
            batch.append(inputs)
            positions.append(position)
            wanted.append(self._wanted(request))
        if batch:
            padded = self.instance.padding_rows
            try:
                results = self.instance.run_batch(batch)
                if self.instance.padding_rows > padded:
                    self.padding.increment(self.instance.padding_rows - padded)
            except AscendError as error:
                results = None
                # InvalidInput here: data only the model could judge (an image that does not decode).
                for position in positions:
                    responses[position] = _error(error)
            if results is not None:
                for position, outputs, names in zip(positions, results, wanted):
                    if self.states is not None:
                        self.states.keep(requests[position].correlation_id(), requests[position].flags(), outputs)
                    responses[position] = _response(outputs, names)
        return responses

    def _stream(self, request) -> None:
        """A decoupled model's request: each response sent as the runtime yields it, then the final flag alone, as
        Triton's repeat backend sends them (an error: one response with the final flag). Once the client has
        cancelled (`is_cancelled`, asked every CANCEL_POLL_S while the runtime works), it stops producing."""
        sender = request.get_response_sender()
        stop = threading.Event()
        threading.Thread(target=_watch_cancellation, args=(sender, stop), daemon=True).start()
        try:
            names = self._wanted(request)
            for outputs in self.instance.responses(self._accepted(request), stop):
                if stop.is_set():  # cancelled
                    break
                sender.send(_response(outputs, names))
        except AscendError as error:
            sender.send(_error(error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        finally:
            stop.set()
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        """Releases the device."""
        self.instance.runtime.close()
        del self.padding  # before its family


#: How often a decoupled request asks whether its client cancelled (python_backend tells only when asked).
CANCEL_POLL_S = 0.1


def _watch_cancellation(sender, stop: threading.Event) -> None:
    while not stop.wait(CANCEL_POLL_S):
        if sender.is_cancelled():
            stop.set()


def _without_traceback(error: AscendError) -> AscendError:
    """A load error as the KServe server gives it (its one line), for raising from `initialize`.

    python_backend reports what escapes `initialize` as pybind11's error_already_set::what() (python_backend
    src/pb_stub.cc): the message, then "At:" and the Python frames of the exception's traceback, which the
    model's repository index reason carries. Raised afresh in `initialize`, the error has that one frame left.
    """
    return error.with_traceback(None)


def _response(outputs: dict[str, np.ndarray], names: list[str]) -> pb_utils.InferenceResponse:
    """A response of the outputs asked for (`names`)."""
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, np.ascontiguousarray(outputs[n])) for n in names])


def _error(error: AscendError) -> pb_utils.InferenceResponse:
    """An error response: INVALID_ARG for the request's fault (InvalidInput), else INTERNAL."""
    code = pb_utils.TritonError.INVALID_ARG if isinstance(error, InvalidInput) else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), code))
