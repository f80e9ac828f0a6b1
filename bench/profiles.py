"""Where a server's CPU goes under load: py-spy on its process tree, so optimisations are chosen from data.

    python bench/profiles.py FILE.folded      # prints the summary of a recording in py-spy's raw format

For a point: the same load is started again (not measured), and after a second of it py-spy
samples the server and every process under it (`--subprocesses`: `--workers N` frontends)
three times in a row, `seconds` each at 100 Hz: into a flame graph (`profile-*.svg`, which a
browser opens), and into collapsed stacks twice, for the text summary's two views
(`profile-*.txt`: samples per process, self samples per package, function and line, inclusive
samples per function): threads that are not idle (py-spy's default: Python frames only, the time
a frame spends in native code it calls counts as that frame's), and the thread holding the GIL
with native frames (`--gil --native`: which C function or syscall a Python frame was in). Not
idle means running or runnable, so on this loaded 2-core machine a thread woken up and waiting
for a core counts too; the GIL view is the work every request of one process queues for.
Threads that native code started and that never run Python are in neither.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_BESIDE = Path(sys.executable).with_name("py-spy")  # the bench extra's
PY_SPY = str(_BESIDE) if _BESIDE.exists() else shutil.which("py-spy")
RATE_HZ = 100
TOP = 25
#: The summary's two views, each its own recording: py-spy's default, and the thread holding the
#: GIL with the native frames under its Python ones (a C extension's work, a syscall made with the GIL held).
VIEWS = {"busy": (), "gil": ("--gil", "--native")}
VIEW_TITLES = {
    "busy": "Threads not idle (py-spy's default: a thread running or runnable; on a loaded machine, waiting for a core counts)",
    "gil": "Holding the GIL, native frames included (py-spy --gil --native: the work every request of a process queues for)",
}
_LINE = re.compile(r":\d+\)$")  # "name (file.py:123)" -> aggregate over lines of one function
_PROCESS = re.compile(r'process (\d+):"([^"]*)";')
_PROCESSES = re.compile(r'(?:process \d+:"[^"]*";)*')


def available() -> str | None:
    """Why profiles cannot be taken here, or None."""
    if not PY_SPY:
        return "py-spy is not installed (`make bench` installs the bench extra)"
    return None


def _py_spy(pid: int, fmt: str, output: Path, seconds: float, *options: str) -> None:
    command = [PY_SPY, "record", "--pid", str(pid), "--subprocesses", *options,
               "--rate", str(RATE_HZ), "--duration", str(max(round(seconds), 1)), "--format", fmt, "--output", str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    if done.returncode or not output.exists():
        raise RuntimeError(f"py-spy failed ({done.returncode}): {(done.stdout + done.stderr).strip()[-1000:]}")


def record(pid: int, load: list[str], stem: Path, title: str, seconds: float) -> dict:
    """Runs `load` (a command that keeps the load up for longer than needed) and records the
    tree under `pid`: `stem`.svg and `stem`.txt. Returns the figures of both views (see `figures`)."""
    generator = subprocess.Popen(load, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # connections open, batches flowing
        _py_spy(pid, "flamegraph", stem.with_suffix(".svg"), seconds)
        views = {}
        with tempfile.TemporaryDirectory() as tmp:
            for view, options in VIEWS.items():
                folded = Path(tmp) / f"{view}.folded"
                _py_spy(pid, "raw", folded, seconds, *options)
                views[view] = folded.read_text()
    finally:
        generator.terminate()
        try:
            generator.wait(timeout=10)
        except subprocess.TimeoutExpired:
            generator.kill()
            generator.wait()
    text = [title, ""]
    for view, stacks in views.items():
        text += [f"# {VIEW_TITLES[view]}", "", summarize(stacks)]
    stem.with_suffix(".txt").write_text("\n".join(text))
    return {view: figures(stacks) for view, stacks in views.items()}


def _stacks(folded: str):
    """(process, frames, samples) per line of py-spy's raw output: `process P:"cmd";...;frame;...;frame N`
    (the process frames, one per generation down to the sampled one, quote command lines that may hold `;`)."""
    for line in folded.splitlines():
        stack, _, count = line.rpartition(" ")
        processes = _PROCESSES.match(stack)
        frames = stack[processes.end():].split(";") if stack[processes.end():] else []
        found = _PROCESS.findall(processes.group())
        process = f"process {found[-1][0]} {found[-1][1][:80]}" if found else "?"
        yield process, frames, int(count)


def _package(frame: str) -> str:
    """The package of a frame's file as py-spy shortens it: "handle (uvicorn/protocols/http/h11_impl.py)" -> uvicorn."""
    where = frame[frame.rfind("(") + 1:-1]
    return where.split("/", 1)[0] if "/" in where else where


def _count(folded: str):
    """Samples in all, and per process, package of the leaf frame, leaf line, leaf function, and function on the stack."""
    per_process, packages, self_lines, self_frames, inclusive = (collections.Counter() for _ in range(5))
    total = 0
    for process, lines, count in _stacks(folded):
        frames = [_LINE.sub(")", line) for line in lines]
        total += count
        per_process[process] += count
        if frames:
            self_lines[lines[-1]] += count
            self_frames[frames[-1]] += count
            packages[_package(frames[-1])] += count
        for frame in set(frames):  # a recursive frame counts once per stack
            inclusive[frame] += count
    return total, per_process, packages, self_lines, self_frames, inclusive


def figures(folded: str, top: int = 8) -> dict:
    """For results.json and the report: samples, and the largest shares of self samples by package and by function."""
    total, _, packages, _, self_frames, _ = _count(folded)
    share = lambda counter: [[key, n / total] for key, n in counter.most_common(top)] if total else []  # noqa: E731
    return {"samples": total, "packages": share(packages), "functions": share(self_frames)}


def summarize(folded: str) -> str:
    """Samples per process, self samples per package, and the top functions by self and inclusive samples."""
    total, per_process, packages, self_lines, self_frames, inclusive = _count(folded)
    if not total:
        return "no samples\n"

    def table(counter, limit=TOP):
        return [f"{n / total:6.1%} {n:7d}  {key}" for key, n in counter.most_common(limit)]

    lines = [f"{total} samples at {RATE_HZ} Hz.", "", "## Samples per process", *table(per_process),
             "", "## Self samples per package (the leaf frame's file)", *table(packages, 15),
             "", f"## Top {TOP} functions by self samples", *table(self_frames),
             "", f"## Top {TOP} lines by self samples", *table(self_lines),
             "", f"## Top {TOP} functions by inclusive samples (on the stack)", *table(inclusive)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]).read_text()))
