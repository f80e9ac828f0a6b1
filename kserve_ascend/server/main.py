"""`kserve-ascend` (`python -m kserve_ascend`): one process serving the models and the edges, or, with
`--workers N`, an engine process owning the models and N frontend processes serving the edges
(`workers.engine`). Either way one `Lifecycle` loads, watches, drains and closes the models.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from prometheus_client import REGISTRY

from ..core.models.repository import Repository
from . import cli, kserve_seam, ports
from .dataplane.local import LocalDataPlane
from .lifecycle import STOP_SIGNALS, Lifecycle
from .model_server import AscendModelServer
from .observability import metrics
from .observability.traces import TraceManager
from .workers.engine import Engine

log = logging.getLogger(__name__)

def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(argv)
    try:
        repository = cli.repository(args)
    except FileNotFoundError as error:
        raise SystemExit(f"kserve-ascend: {error}") from None
    # KServe's HTTP port for these flags (with TLS its default moves to 8443); asking also sets up its logging.
    http_port = kserve_seam.http_port(args.http_port, args.ssl_certfile, args.ssl_keyfile)
    check_ports(args, http_port)
    trace_manager = cli.configure_process(args)
    cli.warn_ignored(args)
    if args.workers > 1:
        Engine(args, repository, http_port, trace_manager).run()
    else:
        serve_one_process(args, repository, trace_manager)


def check_ports(args: argparse.Namespace, http_port: int) -> None:
    """Exits with one line naming a port given twice or another process holds, before anything starts."""
    listening = {"--http_port": (http_port, ports.HTTP)}
    if args.enable_grpc:
        listening["--grpc_port"] = (args.grpc_port, ports.GRPC)
    if args.metrics_port:  # 0: /metrics on the HTTP port only
        listening["--metrics_port"] = (args.metrics_port, ports.METRICS)
    ports.check_distinct({flag: port for flag, (port, _) in listening.items()})
    for port, what in listening.values():
        ports.check_free(port, what)


def lifecycle_of(args: argparse.Namespace, dataplane: LocalDataPlane) -> Lifecycle:
    return Lifecycle(dataplane, args.model_control_mode, args.load_model, args.shutdown_timeout_s)


def serve_one_process(args: argparse.Namespace, repository: Repository, trace_manager: TraceManager) -> None:
    """The models and both edges in this process, until a stop signal has drained them."""
    metrics.register(repository, args.metrics_port)
    dataplane = LocalDataPlane(repository, args.model_control_mode == "explicit", REGISTRY, trace_manager)
    lifecycle = lifecycle_of(args, dataplane)
    server = AscendModelServer(dataplane, cli.edge_settings(args), **cli.kserve_options(args))
    cli.run_event_loop(args, _serve(server, lifecycle))


async def _serve(server: AscendModelServer, lifecycle: Lifecycle) -> None:
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, lifecycle.shut_down, server)
    loading = asyncio.create_task(lifecycle.run(server.listening()))
    await server.serve()  # until the lifecycle has drained the models and stopped the edges
    loading.cancel()
    lifecycle.close()  # nothing is in flight: the devices go
    log.info("server stopped")
