"""The KServe adapter: KServe's ModelServer with this project's OIP v2 edges over the core.

- `main`, `cli`: the command and its flags; `lifecycle`: the models' load, watch, drain and close;
- `dataplane/`: what every edge asks of the server (`DataPlane`), and its implementation over the repository;
- `edges/`: REST, gRPC, KServe's V1 routes and `predict`, the wire codecs, compression and authentication;
- `model_server`: KServe's ModelServer serving the edges over a data plane;
- `workers/`: `--workers N`: the engine process, its frontends, the typed messages and shared memory between them;
- `observability/`: Prometheus metrics and request-scoped logs;
- `kserve_seam`: every use of kserve's internals.
"""

from . import kserve_seam  # noqa: F401  (first: it makes kserve importable beside tritonclient)
