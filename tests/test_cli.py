"""The command line: KServe's flags as parent, the project's own, and what it refuses."""

import re
import subprocess
import sys

import requests

from conftest import REPOSITORY, ROOT, start_server, stop_server

#: KServe's flags this server honours, and its own.
HONOURED = (
    "--http_port", "--grpc_port", "--workers", "--max_asyncio_workers", "--enable_grpc", "--enable_docs_url",
    "--event-loop", "--timeout-keep-alive", "--grpc_max_receive_message_length", "--ssl_certfile", "--ssl_keyfile",
)
OWN = ("--model_dir", "--config", "--model_control_mode", "--metrics_port", "--shutdown_timeout_s", "--auth_token_file")
#: KServe's flags it has no use for (transformer flags, a gRPC thread pool it does not have, ...).
HIDDEN = (
    "--model_name", "--predictor_host", "--protocol", "--predictor_protocol", "--predictor_use_ssl",
    "--predictor_request_timeout_seconds", "--predictor_request_retries", "--enable_predictor_health_check",
    "--max_threads", "--enable_latency_logging",
)


def run(*args):
    return subprocess.run([sys.executable, "-m", "kserve_ascend", *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_help_lists_the_flags_this_server_honours_and_hides_those_it_ignores():
    result = run("--help")
    assert result.returncode == 0
    listed = set(re.findall(r"(?<![\w-])--[\w-]+", result.stdout))
    assert set(HONOURED + OWN) <= listed
    assert not listed & set(HIDDEN)


def test_ignored_kserve_flags_are_accepted_with_a_warning_each(tmp_path):
    """A ServingRuntime written for KServe's own servers may pass them (`--model_name={{.Name}}`)."""
    server = start_server(
        tmp_path, tmp_path / "server.log", "--model_name=yolo", "--predictor_host", "localhost:9", "--protocol", "v2",
        "--max_threads", "8", "--enable_predictor_health_check",
    )
    try:
        assert requests.get(f"{server.url}/v2/health/ready").status_code == 200
    finally:
        stop_server(server)
    warned = re.findall(r"WARNING.*(--\w+) is ignored: (.*)", server.output())
    given = ["--model_name", "--predictor_host", "--protocol", "--enable_predictor_health_check", "--max_threads"]
    assert [flag for flag, _ in warned] == given
    assert dict(warned)["--predictor_host"] == "a KServe transformer's flag: this server is the predictor, it calls none"


def test_model_dir_defaults_to_mnt_models():
    from kserve_ascend.server.cli import build_parser

    args = build_parser().parse_args([])
    assert args.model_dir == "/mnt/models"
    assert (args.http_port, args.grpc_port) == (8080, 8081)


def test_fewer_than_one_worker_is_refused_with_the_reason():
    result = run("--model_dir", str(REPOSITORY), "--workers", "0")
    assert result.returncode != 0
    assert "--workers must be at least 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_repository_is_a_clear_error():
    result = run("--model_dir", "/nonexistent/models")
    assert result.returncode != 0
    assert "model repository /nonexistent/models is not a directory" in result.stderr
    assert "Traceback" not in result.stderr
