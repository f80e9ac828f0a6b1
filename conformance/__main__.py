"""`python -m conformance --http HOST:PORT --grpc HOST:PORT [--target NAME] [--report FILE] [pytest args]`."""

import argparse
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).resolve().parent / "cases"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    parser.add_argument("--http", required=True, help="HOST:PORT of the server's OIP REST endpoint")
    parser.add_argument("--grpc", required=True, help="HOST:PORT of the server's OIP gRPC endpoint")
    parser.add_argument("--target", default="server", help="name of the server in the report and in deviations.yaml")
    parser.add_argument("--report", default="conformance-report.md", help="markdown report; a column per target")
    args, pytest_args = parser.parse_known_args(argv)
    return pytest.main(
        [
            str(CASES),
            "-p", "conformance.plugin",
            "--rootdir", str(CASES.parent),
            "-o", "addopts=",
            "-q",
            f"--oip-http={args.http}",
            f"--oip-grpc={args.grpc}",
            f"--oip-target={args.target}",
            f"--oip-report={args.report}",
            *pytest_args,
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
