"""Run by tests/test_cann_ep.py with the interpreter of the `ascend` virtualenv (onnxruntime-cann),
whose ONNX Runtime cannot share a process with the CPU build of the test process. Prints JSON.

  probe.py load MODEL CASES_JSON DEVICE_ID MAX_BATCH_SIZE
      the project's OnnxRuntime loads MODEL under a config with each of a list of `parameters`
      dicts: for each, what it chose (info, the provider options ORT applied, batch sizes) or
      the load error;
  probe.py run MODEL
      the project's OnnxRuntime loads MODEL with `execution_provider: cann` and runs it once on
      zeros (the provider compiles and saves on that first run): the working directory then, and
      the run's error (the stubs compute nothing, so a run that gets past compiling fails later);
  probe.py ort MODEL OPTIONS_JSON
      plain onnxruntime, as any user calls it, with CANNExecutionProvider and each of a list of
      option dicts: for each, the providers the session ended on and what ORT printed;
  probe.py mixed ORDER OM MODEL PRIMING
      one process serving a (FAKE pyACL) `.om` OM and an ONNX MODEL on `execution_provider: cann`,
      loaded in ORDER ("om,cann" or "cann,om"): what the ONNX model chose or its load error, the
      `.om`'s output while both are loaded and after the ONNX model closed, the `acl.init` return
      codes and whether ACL is up at the end. PRIMING "off" disables the acl runtime's letting
      onnxruntime initialise ACL first (to show what it prevents). Needs the FAKE pyACL on PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
from pathlib import Path


def load(model: str, cases: str, device_id: str, max_batch_size: str) -> list[dict]:
    from tritonclient.grpc import model_config_pb2 as mc

    from kserve_ascend.core.errors import ModelLoadError
    from kserve_ascend.core.execution.runtimes import load_runtime

    results = []
    for parameters in json.loads(cases):
        config = mc.ModelConfig(name="probe", max_batch_size=int(max_batch_size))
        for key, value in parameters.items():
            config.parameters[key].string_value = value
        try:
            runtime = load_runtime(config, Path(model), int(device_id))
        except ModelLoadError as error:
            results.append({"error": str(error)})
            continue
        results.append({
            "info": dict(runtime.info),
            "provider_options": runtime.session.get_provider_options(),
            "batch_sizes": list(runtime.batch_sizes),
            "compiles_per_shape": runtime.compiles_per_shape,
            "memory": [runtime.memory_bytes, getattr(runtime, "memory_source", None)],
        })
        runtime.close()
    return results


def run(model: str) -> dict:
    import os

    import numpy as np
    from tritonclient.grpc import model_config_pb2 as mc

    from kserve_ascend.core import datatypes
    from kserve_ascend.core.errors import ModelLoadError
    from kserve_ascend.core.execution.runtimes import load_runtime

    config = mc.ModelConfig(name="probe")
    config.parameters["execution_provider"].string_value = "cann"
    try:
        runtime = load_runtime(config, Path(model), 0)
    except ModelLoadError as error:
        return {"error": str(error), "cwd": os.getcwd()}
    zeros = {s.name: np.zeros([max(d, 1) for d in s.shape], datatypes.to_numpy(s.datatype)) for s in runtime.inputs}
    try:
        runtime.run(zeros, [s.name for s in runtime.outputs])
        result = {"ran": True}
    except Exception as error:  # ORT's own exception types
        result = {"run_error": str(error)}
    return {**result, "cwd": os.getcwd()}


def ort(model: str, cases: str) -> list[dict]:
    import onnxruntime

    results = []
    for options in json.loads(cases):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # ORT's fallback prints why, and goes on
            session = onnxruntime.InferenceSession(
                model, providers=[("CANNExecutionProvider", options), "CPUExecutionProvider"]
            )
        results.append({"providers": session.get_providers(), "printed": printed.getvalue(),
                        "provider_options": session.get_provider_options()})
    return results


def mixed(order: str, om: str, model: str, priming: str) -> dict:
    import acl  # the FAKE pyACL (tests/fake_acl), on FAKE_ACL_LIBRARY's ACL when set
    import numpy as np
    from tritonclient.grpc import model_config_pb2 as mc

    from kserve_ascend.core.errors import DeviceError, ModelLoadError
    from kserve_ascend.core.execution.runtimes import load_runtime
    from kserve_ascend.core.execution.runtimes import onnx as onnx_runtime

    if priming == "off":
        onnx_runtime.initialise_acl = lambda device_id: None
    config = mc.ModelConfig(name="cann", max_batch_size=8)
    config.parameters["execution_provider"].string_value = "cann"
    result, runtimes = {}, {}
    for name in order.split(","):
        try:
            if name == "om":
                runtimes[name] = load_runtime(mc.ModelConfig(name="om"), Path(om), 0)
            else:
                runtimes[name] = load_runtime(config, Path(model), 0)
                result["cann"] = dict(runtimes[name].info)
                result["cann_memory"] = [runtimes[name].memory_bytes, getattr(runtimes[name], "memory_source", None)]
        except ModelLoadError as error:
            result[name] = {"error": str(error)}

    def run_om() -> object:
        try:
            return runtimes["om"].run({"x": np.full((4, 3), 2.5, np.float32)}, [])["x_out"].tolist()
        except DeviceError as error:
            return {"error": str(error)}

    result["om_output"] = run_om()
    if "cann" in runtimes:
        runtimes.pop("cann").close()
    result["om_output_after_cann_closed"] = run_om()
    try:
        runtimes["om"].close()
    except DeviceError as error:
        result["om_close"] = str(error)
    result["acl_init"] = [call.result for call in acl.fake_calls() if call.name == "acl.init"]
    result["acl_finalize"] = [call.result for call in acl.fake_calls() if call.name == "acl.finalize"]
    result["acl_up"] = acl.fake_initialized()
    return result


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    command, *args = sys.argv[1:]
    print(json.dumps({"load": load, "run": run, "ort": ort, "mixed": mixed}[command](*args)))
