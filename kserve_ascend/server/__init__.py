"""The KServe adapter: kserve's ModelServer with this project's OIP v2 edges over the core.

kserve and tritonclient both register protobuf package `inference` in the default
descriptor pool, under different file names, so importing both fails with
"duplicate symbol 'inference.ServerLiveRequest'" (kserve/kserve#3099). Triton's
grpc_service.proto is a superset of KServe's grpc_predict_v2.proto on the same wire,
so this process loads Triton's and points kserve's module name at it. This must run
before kserve is imported, hence here, at the top of the only package that imports kserve.
"""

import argparse
import sys

from tritonclient.grpc import service_pb2 as _triton_service_pb2

sys.modules.setdefault("kserve.protocol.grpc.grpc_predict_v2_pb2", _triton_service_pb2)

# kserve parses sys.argv when imported, abbreviations allowed, and would take `--config`
# (the CANN config.yaml) for its own `--configure_logging`: it is imported here, once,
# with the command line minus that flag.
_config_flag = argparse.ArgumentParser(prog="kserve-ascend", add_help=False, allow_abbrev=False)
_config_flag.add_argument("--config")
_argv, sys.argv = sys.argv, sys.argv[:1] + _config_flag.parse_known_args(sys.argv[1:])[1]
try:
    import kserve  # noqa: E402,F401
finally:
    sys.argv = _argv
