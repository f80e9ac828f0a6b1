"""Every shell and Python snippet of README.md and docs/*.md runs as written, against real servers.

A page's ```sh and ```python blocks run in the order a reader meets them, from a scratch directory
that looks like a fresh clone (the repository's files linked in, so what a snippet writes stays out
of the tree), with .venv activated as the README asks, on the ports the page names. The pages follow
conventions a reader sees too:
- a block that says "until Ctrl-C" starts a server: it runs in the background until the page's next
  such block or the page's end, and the next block waits until it answers on the port it serves;
- a ```text block right after a runnable block is that block's output ("..." stands for anything);
  without one, a block whose output holds an OIP error body (`{"error"`) fails;
- a block whose first line ends in `# needs: <what>` does not run here, and <what> must be one of NEEDS.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from markdown_it import MarkdownIt

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: What a snippet may need that this machine (and CI) lacks.
NEEDS = ("an Ascend host", "a Kubernetes cluster", "a Docker engine", "github.com", "an S3 bucket", "minutes")
#: Where each kind of server answers, by what its block's commands say: (port, scheme).
SERVER_PORTS = {"make triton": (8000, "http"), "ssl_certfile": (8443, "https"), "": (8080, "http")}
#: The fixed ports the pages use: each must be free before a page runs.
PAGE_PORTS = (8080, 8081, 9090, 8000, 8001, 8002, 8443)


@dataclass
class Snippet:
    language: str  # "sh" or "python"
    code: str
    line: int  # in the page, for messages
    expected: str | None = None  # the ```text block after it

    @property
    def needs(self) -> str | None:
        marker = re.search(r"#\s*needs:\s*(.+)$", self.code.lstrip().splitlines()[0])
        return marker.group(1).strip() if marker else None

    @property
    def serves(self) -> bool:
        return "until Ctrl-C" in self.code


def snippets(page: Path) -> list[Snippet]:
    """The page's runnable blocks, each with the ```text block that directly follows it."""
    found: list[Snippet] = []
    previous = None
    for token in MarkdownIt().parse(page.read_text()):
        if token.type == "fence":
            language = token.info.split()[0] if token.info else ""
            if language in ("sh", "python"):
                found.append(Snippet(language, token.content, token.map[0] + 1))
            elif language == "text" and previous is not None and previous.type == "fence" and found \
                    and found[-1].line == previous.map[0] + 1:
                found[-1].expected = token.content
        previous = token
    return found


def matches(expected: str, output: str) -> bool:
    """Whether `output` shows `expected`, whose "..." stands for anything and whose runs of
    whitespace for any whitespace (or none: JSON may be printed compactly or not)."""
    parts = [r"\s*".join(re.escape(word) for word in chunk.split()) for chunk in expected.strip().split("...")]
    return re.search(r"\s*.*?\s*".join(parts), output, re.DOTALL) is not None


class Page:
    """One page's run: its scratch directory, environment and the server in the background."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        (ROOT / "build").mkdir(exist_ok=True)  # where the tools write (gitignored), shared with the clone's
        for entry in ROOT.iterdir():
            if entry.name not in (".git", ".pytest_cache"):
                (workdir / entry.name).symlink_to(entry)
        venv = ROOT / ".venv"
        self.env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
        self.env.pop("PYTHONPATH", None)
        self.server: subprocess.Popen | None = None
        self.server_log = workdir / "server.log"

    def run(self, snippet: Snippet) -> str:
        if snippet.serves:
            self.stop()
            return self.serve(snippet)
        if snippet.language == "python":
            script = self.workdir / f"snippet_{snippet.line}.py"
            script.write_text(snippet.code)
            command = ["python", script.name]
        else:
            command = ["bash", "-euo", "pipefail", "-c", snippet.code]
        result = subprocess.run(command, cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=600)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"exit {result.returncode}:\n{output[-4000:]}{self.server_tail()}"
        return result.stdout

    def serve(self, snippet: Snippet) -> str:
        command = "\n".join(line.split("#", 1)[0] for line in snippet.code.splitlines())
        port, scheme = next(v for key, v in SERVER_PORTS.items() if key in command)
        with open(self.server_log, "wb") as log:
            self.server = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", snippet.code], cwd=self.workdir, env=self.env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        url = f"{scheme}://localhost:{port}/v2/health/ready"
        for _ in range(1500):  # 300 s: `make serve` may install first
            assert self.server.poll() is None, f"the server exited with {self.server.returncode}{self.server_tail()}"
            try:
                if requests.get(url, timeout=1, verify=False).status_code == 200:
                    return ""
            except requests.ConnectionError:
                pass
            try:
                self.server.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        raise AssertionError(f"the server did not get ready on {url}{self.server_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's process group (make, and the server it started), as Ctrl-C would."""
        if self.server is None or self.server.poll() is not None:
            return
        os.killpg(self.server.pid, signal.SIGTERM)
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
            raise AssertionError(f"the server did not stop on SIGTERM{self.server_tail()}")

    def server_tail(self) -> str:
        if self.server is None:
            return ""
        return "\n--- server log ---\n" + self.server_log.read_text(errors="replace")[-3000:]


def port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_snippet_runs_as_written(page, tmp_path):
    busy = [port for port in PAGE_PORTS if port_in_use(port)]
    assert not busy, f"the pages' snippets run on the ports they name, and {busy} are in use here: stop what holds them"
    run = Page(tmp_path)
    ran, skipped = 0, []
    try:
        for snippet in snippets(page):
            where = f"{page.relative_to(ROOT)}:{snippet.line}"
            if snippet.needs is not None:
                assert snippet.needs.startswith(NEEDS), f"{where}: '# needs: {snippet.needs}' is not a reason to skip ({NEEDS})"
                skipped.append(where)
                continue
            try:
                output = run.run(snippet)
            except AssertionError as failure:
                raise AssertionError(f"{where}: {failure}\n--- snippet ---\n{snippet.code}") from None
            if snippet.expected is not None:
                assert matches(snippet.expected, output), f"{where}: expected\n{snippet.expected}\ngot\n{output[-4000:]}"
            else:
                assert '{"error"' not in output, f"{where}: answered an error:\n{output[-4000:]}"
            ran += 1
    finally:
        run.stop()
    print(f"{page.name}: {ran} snippets ran, {len(skipped)} need what is not here: {skipped}")


def test_the_snippet_conventions_hold(tmp_path):
    """The runner's own rules, on a page written for them: a check that cannot fail is no check."""
    page = """
```sh
make serve   # until Ctrl-C
```

```sh
curl localhost:8080/v2
```

```text
{"name": "kserve-ascend", ...}
```

Prose between.

```text
not an expected output: prose came between
```

```python
# needs: an Ascend host
```
"""
    (tmp_path / "page.md").write_text(page)
    found = snippets(tmp_path / "page.md")
    assert [s.serves for s in found] == [True, False, False]
    assert found[1].expected == '{"name": "kserve-ascend", ...}\n'
    assert found[0].expected is None and found[2].expected is None
    assert found[2].needs == "an Ascend host"
    assert matches('{"name": "kserve-ascend", ...}', '{"name":"kserve-ascend","version":"0.1.0"}')
    assert matches("[0 0]\n[2 3 ... 17]", "[0 0]\n[ 2  3  4 17]") is False  # "[2" is not "[ 2": no space expected, none allowed
    assert matches("[0 0] ... 17]", "[0 0]\n[ 2  3  4 17]")
    assert not matches('{"name": "triton"}', '{"name":"kserve-ascend"}')

