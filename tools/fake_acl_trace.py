"""Writes the shipped pyACL trace tests/data/acl_traces/fake-relu-gears.json (or the file named):
the session `make check-ascend` records on a host (kserve_ascend/core/execution/runtimes/acl_trace.py,
`check`), here with the FAKE pyACL of tests/fake_acl on a fake `.om` shaped as ATC compiles the
host check's Relu model: x and y FP32 [-1, 4], dynamic batch gears 1, 2, 4, ATC's output name.

    python tools/fake_acl_trace.py [TRACE]
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

from kserve_ascend.core.execution.runtimes.acl_trace import TRACES, check_config, dump, record

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else TRACES / "fake-relu-gears.json"
    spec = importlib.util.spec_from_file_location("fake_acl", ROOT / "tests" / "fake_acl" / "acl.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    with tempfile.TemporaryDirectory() as work:
        om = fake.fake_write_om(Path(work, "check.om"), [("x", fake.ACL_FLOAT, [-1, 4])],
                                outputs=[("y", fake.ACL_FLOAT, [-1, 4])], dynamic_batch=[1, 2, 4], atc_names=True,
                                relu=True)
        written, _ = record(fake, om, check_config())
    written["host"].update(acl="FAKE pyACL, tests/fake_acl/acl.py", written_by="python tools/fake_acl_trace.py")
    trace.write_text(dump(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
