"""Runs the OIP v2 conformance suite against a server; further arguments go to pytest (e.g. -k infer).

    python -m conformance --serve {kserve-ascend,triton}     start that server on conformance/models, run, stop it
    python -m conformance --http HOST:PORT --grpc HOST:PORT  a server you run, serving conformance/models
"""

import argparse
import sys
from pathlib import Path

import pytest

from conformance.harness import NotReady
from conformance.serve import SERVERS, served

CASES = Path(__file__).resolve().parent / "cases"
#: build/ is not committed: a run never leaves the tree dirty.
DEFAULT_REPORT = CASES.parent.parent / "build" / "conformance" / "report.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve", choices=SERVERS, help="start this server of the project for the run; its log goes beside the report")
    parser.add_argument("--http", metavar="HOST:PORT", help="the OIP REST endpoint of a server you run")
    parser.add_argument("--grpc", metavar="HOST:PORT", help="the OIP gRPC endpoint of a server you run")
    parser.add_argument("--target", help="name of the server in the report and in deviations.yaml (default: --serve's, else 'server')")
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT,
                        help="markdown report with a column per target, merged across runs (default: build/conformance/report.md)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.serve and (args.http or args.grpc):
        parser.error("--serve starts its own server: give --serve, or --http and --grpc, not both")
    if not args.serve and not (args.http and args.grpc):
        parser.error("give --serve {kserve-ascend,triton}, or --http and --grpc of a server you run")
    target = args.target or args.serve or "server"
    report = args.report.resolve()
    report.parent.mkdir(parents=True, exist_ok=True)
    if not args.serve:
        return run(args.http, args.grpc, target, report, pytest_args)
    try:
        with served(args.serve, report.parent) as (http, grpc):
            return run(http, grpc, target, report, pytest_args)
    except NotReady as error:
        parser.exit(1, f"python -m conformance: {error}\n")


def run(http: str, grpc: str, target: str, report: Path, pytest_args: list[str]) -> int:
    return pytest.main(
        [
            str(CASES),
            "-p", "conformance.plugin",
            "--rootdir", str(CASES.parent),
            "-o", "addopts=",
            "-q",
            f"--oip-http={http}",
            f"--oip-grpc={grpc}",
            f"--oip-target={target}",
            f"--oip-report={report}",
            *pytest_args,
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
