"""The command line: KServe's flags as parent, the project's own, and what it refuses."""

import subprocess
import sys

from conftest import REPOSITORY, ROOT


def run(*args):
    return subprocess.run([sys.executable, "-m", "kserve_ascend", *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_help_lists_kserve_flags_and_model_dir():
    result = run("--help")
    assert result.returncode == 0
    for flag in ("--http_port", "--grpc_port", "--workers", "--model_dir", "--ssl_certfile", "--enable_grpc"):
        assert flag in result.stdout


def test_model_dir_defaults_to_mnt_models():
    from kserve_ascend.server.app import build_parser

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
