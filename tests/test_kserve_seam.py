"""The one seam to kserve's internals (kserve_ascend/server/kserve_seam.py), against the installed kserve.

A kserve release that moves what the seam relies on fails here, naming it, before a server
test fails somewhere less telling.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import requests

import kserve_ascend.server  # noqa: F401  (first: it makes kserve importable beside tritonclient)
from kserve_ascend.server import kserve_seam

from conftest import ROOT, free_port


def test_everything_the_seam_relies_on_is_there():
    assert kserve_seam.missing() == []


def test_kserve_imports_beside_tritonclient_and_leaves_config_to_this_server():
    """kserve parses sys.argv as it is imported, abbreviations allowed: `--config FILE` (the CANN config.yaml) must
    not reach it as its own `--configure_logging`, and its protobuf module must not clash with tritonclient's."""
    program = (
        "import sys; sys.argv = ['kserve-ascend', '--config', 'server.yaml'];"
        "import kserve_ascend.server; import tritonclient.grpc; from kserve import model_server;"
        "print(model_server.args.configure_logging)"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "True"  # kserve's default: it did not take 'server.yaml' for its flag


def test_the_http_port_is_kserves():
    """With TLS, KServe's ModelServer moves its default HTTP port from 8080 to 8443; a port given stays."""
    assert kserve_seam.http_port(8080, None, None) == 8080
    assert kserve_seam.http_port(8080, "tls.crt", "tls.key") == 8443
    assert kserve_seam.http_port(9000, "tls.crt", "tls.key") == 9000


def test_hidden_flags_are_accepted_and_left_out_of_help():
    parser = kserve_seam.parser(hidden={"predictor_host": "a transformer's flag"})
    assert "--predictor_host" not in parser.format_help()
    assert "--http_port" in parser.format_help()
    known, _ = parser.parse_known_args(["--predictor_host", "x"])
    assert known.predictor_host == "x"
    assert not hasattr(parser.parse_known_args([])[0], "predictor_host")  # present only when given


def test_the_rest_server_serves_the_app_in_front_of_kserves_until_stopped():
    """KServe's REST server serves this server's app, which wraps KServe's (its V1 routes behind); a stop lets it
    finish what it accepted and return, without uvicorn's own signal handling."""
    port = free_port()
    seen = []

    def in_front(kserve_app):
        async def app(scope, receive, send):
            if scope["type"] == "http" and scope["path"] == "/ours":
                seen.append(scope["path"])
                await send({"type": "http.response.start", "status": 200, "headers": []})
                return await send({"type": "http.response.body", "body": b"ours"})
            await kserve_app(scope, receive, send)

        return app

    async def scenario() -> tuple[str, int]:
        server = kserve_seam.kserve.ModelServer(http_port=port, enable_grpc=False)
        rest = kserve_seam.RestServer(server, in_front)
        serving = asyncio.create_task(rest.serve())
        while not rest.started:
            await asyncio.sleep(0.05)
        assert [sock.getsockname()[1] for sock in rest.listening_sockets()] == [port]
        ours = await asyncio.to_thread(requests.get, f"http://127.0.0.1:{port}/ours", timeout=10)
        kserves = await asyncio.to_thread(requests.get, f"http://127.0.0.1:{port}/v1/models", timeout=10)
        rest.stop(grace=1)
        await asyncio.wait_for(serving, 10)
        return ours.text, kserves.status_code

    assert asyncio.run(scenario()) == ("ours", 200)
    assert seen == ["/ours"]
