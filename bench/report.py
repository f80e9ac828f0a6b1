"""The bench's outputs from its raw numbers: results.json, results.md, qps_p99.png and side_by_side.png.

    python bench/report.py bench/results/results.json   # re-renders results.md and the plots

A target is met or missed on the unrounded figures of one run, and its measured value is printed
with as many digits as it takes to show the verdict (never "2.00× MISS ≥ 2×").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


#: Cores taken by processes outside the bench above which a point is marked as measured on a busy machine.
NOISY_CORES = 0.2
PROTOCOL_NAMES = {
    "http": "JSON/HTTP (hey)",
    "binary": "binary/HTTP (perf_analyzer)",
    "grpc": "gRPC raw (perf_analyzer)",
    "grpc-py": "gRPC raw (tritonclient asyncio)",
    "call": "in-process call",
}
#: Line style of each load in the plot, and its name.
PROTOCOL_STYLES = {"http": ("-", "solid"), "binary": ("-.", "dash-dot"), "grpc": ("--", "dashed"), "grpc-py": (":", "dotted")}
#: The side-by-side comparison: its servers (scenario -> column), models and loads.
PEERS = {"batch": "kserve-ascend --workers 1", "workers2": "kserve-ascend --workers 2", "triton": "Triton 2.51 + ascend",
         "mlserver": "MLServer 1.7.1", "stock": "stock KServe 0.21"}
SIDE_BY_SIDE_MODELS = ("simple", "fastsim")
SIDE_BY_SIDE_LOADS = ("http", "grpc", "grpc-py")
#: perf_analyzer needs Triton's model configuration extension, which these servers lack.
NO_MODEL_CONFIG = frozenset({"mlserver", "stock"})
#: Scenarios in the order of their colours (matplotlib's tab10) in both plots, whichever scenarios a run has.
COLOURED = ("raw", "nobatch", "batch", "workers2", "triton", "mlserver", "stock")


def _pyplot():
    """matplotlib (the bench extra), imported to draw: the tables and `run.py --help` run without it."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def find(points, model, scenario, protocol, concurrency=None) -> list[dict]:
    return [
        p for p in points
        if p["model"] == model and p["scenario"] == scenario and p["protocol"] == protocol
        and (concurrency is None or p["concurrency"] == concurrency)
    ]


def one(points, model, scenario, protocol, concurrency) -> dict | None:
    return next(iter(find(points, model, scenario, protocol, concurrency)), None)


def peak(points, model, scenario, protocol) -> dict | None:
    found = find(points, model, scenario, protocol)
    return max(found, key=lambda p: p["qps"]) if found else None


def device_limit(model: str) -> float:
    """The rows/s a simulated device can do at most: full batches of max_batch_size, back to back."""
    from payloads import model_dir

    from kserve_ascend.core.config import read_config

    config = read_config(model_dir(model))
    fixed, per_item = (float(config.parameters[key].string_value) for key in ("sim_fixed_ms", "sim_per_item_ms"))
    return config.max_batch_size / (fixed + per_item * config.max_batch_size) * 1000


def targets(points: list[dict]) -> list[dict]:
    """Each target: what was measured, against what, whether it is met (on unrounded figures), and the
    kserve-ascend point it measures (`at`: scenario, model, protocol, concurrency), whose profile explains a miss."""
    rows = []

    def add(source, what, value, op, target, unit, basis, at=None):
        met = None if value is None else (value >= target if op == ">=" else value <= target)
        rows.append({"source": source, "what": what, "value": value, "op": op, "target": target, "unit": unit, "met": met,
                     "basis": basis, "at": at})  # fmt: skip

    def ratio(a, b, key="qps"):
        return a[key] / b[key] if a and b and a.get(key) is not None and b.get(key) else None

    def at(p, key):
        return p[key] if p else None

    for protocol in ("http", "grpc"):
        mine, triton = one(points, "simple", "batch", protocol, 16), one(points, "simple", "triton", protocol, 16)
        add("issues 17, 28", f"simple: kserve-ascend CPU/request ÷ Triton's ({protocol})", ratio(mine, triton, "server_cpu_ms"),
            "<=", 1.3, "×", f"c=16, {PROTOCOL_NAMES[protocol]}, --workers 1", ("batch", "simple", protocol, 16))
    limit = device_limit("fastsim")
    for protocol in ("http", "grpc"):
        mine, triton = one(points, "fastsim", "batch", protocol, 64), one(points, "fastsim", "triton", protocol, 64)
        basis, point = f"c=64, {PROTOCOL_NAMES[protocol]}, --workers 1", ("batch", "fastsim", protocol, 64)
        add("issues 17, 28", f"fastsim: kserve-ascend ÷ Triton requests/s ({protocol})", ratio(mine, triton), ">=", 1.0, "×", basis, point)
        add("issue 28", f"fastsim: requests/s ÷ the device's limit ({protocol})", at(mine, "qps") and at(mine, "qps") / limit,
            ">=", 0.9, "×", f"{basis}; the limit: {limit:,.0f} rows/s", point)
    for model in ("simple", "fastsim"):
        for protocol in ("http", "grpc"):
            mine, triton = one(points, model, "batch", protocol, 64), one(points, model, "triton", protocol, 64)
            add("issue 28", f"{model}: p99 ÷ Triton's ({protocol})", ratio(mine, triton, "p99_ms"), "<=", 1.5, "×",
                f"c=64, {PROTOCOL_NAMES[protocol]}, --workers 1", ("batch", model, protocol, 64))
    for protocol in ("http", "grpc"):
        batch, plain = one(points, "sim", "batch", protocol, 10), one(points, "sim", "nobatch", protocol, 10)
        basis, point = f"c=10, {PROTOCOL_NAMES[protocol]}", ("batch", "sim", protocol, 10)
        add("issues 17, 28", f"sim: batching ÷ no batching ({protocol})", ratio(batch, plain), ">=", 5.7, "×", basis, point)
        add("issue 17 (4)", f"sim: batching mean latency ({protocol})", at(batch, "mean_ms"), "<=", 37, "ms", basis, point)
        add("issues 17, 28", f"sim: batching p99 latency ({protocol})", at(batch, "p99_ms"), "<=", 60, "ms", basis, point)
    raw = max(find(points, "yolov8n", "raw", "call"), key=lambda p: p["concurrency"], default=None)  # at max_batch_size
    yolo = peak(points, "yolov8n", "batch", "grpc")
    add("earlier", "yolov8n: kserve-ascend batching ÷ raw executor", ratio(yolo, raw), ">=", 0.90, "×", "peak gRPC QPS ÷ rows/s at max_batch_size")
    add("earlier", "yolov8n: kserve-ascend batching ÷ Triton", ratio(yolo, peak(points, "yolov8n", "triton", "grpc")), ">=", 1.0, "×", "peak gRPC QPS")
    # Each comparison under one load generator: stock KServe's gRPC load is tritonclient's (perf_analyzer cannot drive it).
    for baseline, target, protocols in (("stock", 2.0, ("http", "grpc-py")), ("triton", 0.5, ("http", "grpc"))):
        for protocol in protocols:
            mine = peak(points, "simple", "batch", protocol)
            name = "stock KServe" if baseline == "stock" else "Triton"
            add("earlier", f"simple: kserve-ascend ÷ {name} ({protocol})", ratio(mine, peak(points, "simple", baseline, protocol)),
                ">=", target, "×", f"peak QPS, {PROTOCOL_NAMES[protocol]}")
    return rows


def shown(value: float, op: str, target: float, met: bool, digits: int) -> str:
    """`value` with `digits` decimals, or more until the printed number gives the same verdict as the value."""
    for d in range(digits, 8):
        text = f"{value:,.{d}f}"
        printed = float(text.replace(",", ""))
        if (printed >= target if op == ">=" else printed <= target) == met:
            return text
    return repr(value)


def _n(value, digits=1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _model_first(at: tuple | None) -> tuple:
    """A target's point (scenario, model, protocol, concurrency) as `one` takes it (model first)."""
    return (at[1], at[0], *at[2:]) if at else (None, None, None, None)


def _batches(p: dict) -> str:
    """A point's batches, from the server's statistics: what a batching target's miss is made of."""
    return f"{p['mean_batch']:.2f} rows per execution, the device busy {p['device_busy']:.0%} of the time"


def _cell(p: dict | None) -> str:
    if p is None:
        return "–"
    if p["errors"] and not p["qps"]:
        return "failed"
    errors = f" ({p['errors']} errors)" if p["errors"] else ""
    return f"{p['qps']:,.0f} · {_n(p.get('server_cpu_ms'), 3)} · {_n(p['p99_ms'])}{errors}"


def side_by_side(run: dict) -> list[str]:
    points, skipped = run["points"], run.get("skipped", {})
    peers = [s for s in PEERS if s in run["scenarios"] or s in skipped]
    lines = [
        "| model | load | c | " + " | ".join(PEERS[s] for s in peers) + (" | --workers 2 ÷ 1: requests/s, CPU/request |" if "workers2" in peers else " |"),
        "| --- | --- | ---: | " + " | ".join("---:" for _ in peers) + (" | ---: |" if "workers2" in peers else " |"),
    ]
    for model in SIDE_BY_SIDE_MODELS:
        for protocol in SIDE_BY_SIDE_LOADS:
            for concurrency in run["concurrency"].get(model, ()):
                cells = []
                for scenario in peers:
                    if scenario in skipped:
                        cells.append("not run")
                    elif protocol in ("grpc", "binary") and scenario in NO_MODEL_CONFIG:
                        cells.append("n/a¹")
                    else:
                        cells.append(_cell(one(points, model, scenario, protocol, concurrency)))
                if "workers2" in peers:
                    one_, two = one(points, model, "batch", protocol, concurrency), one(points, model, "workers2", protocol, concurrency)
                    if one_ and two and one_["qps"] and one_.get("server_cpu_ms") and two.get("server_cpu_ms"):
                        cells.append(f"{two['qps'] / one_['qps']:.2f}×, {two['server_cpu_ms'] / one_['server_cpu_ms']:.2f}×")
                    else:
                        cells.append("–")
                lines.append(f"| {model} | {PROTOCOL_NAMES[protocol]} | {concurrency} | " + " | ".join(cells) + " |")
    return lines


def markdown(run: dict) -> str:
    points, scenarios = run["points"], run["scenarios"]
    quick = ["", "**A `--quick` run: 1 s per point, a check that the bench runs, not a measurement.**"] if run.get("quick") else []
    lines = [
        "# kserve-ascend bench",
        *quick,
        "",
        f"{run['date']} · {run['machine']} · {run['duration_s']:g} s measured per point after {run['warmup_s']:g} s of the same load"
        f" · whole run {run['seconds'] / 60:.1f} min · code at {run['code']} · closed loop, client and server on the same cores, loopback only.",
        "",
        "Scenarios: " + "; ".join(f"**{key}** = {label}" for key, label in scenarios.items()) + ".",
        *[f"**{s}** was not run: {reason}" for s, reason in run.get("skipped", {}).items()],
        f"`simple` in the batching repository (kserve-ascend batching and Triton): `{run['simple_batching']}`;"
        " MLServer batches `sim` and `fastsim` adaptively with their max_batch_size and queue delay, and not `simple`;"
        " stock KServe does not batch. A raw row's concurrency is its batch size, its QPS rows/s, its latency that of one batch.",
        "**Server CPU ms/request**: CPU time of the server's process tree (Triton's python stubs, MLServer's inference worker,"
        " kserve-ascend's frontends) over the requests it answered in the same span: a point's warm-up and window, counted by"
        " the client (hey, tritonclient) or, under perf_analyzer, by the server's statistics."
        " Cores: mean cores used during the point by the server, by the load generator (for raw: the executor), and by"
        f" everything else; ⚠ marks points where others took more than {NOISY_CORES} of a core.",
        "",
        "## Targets",
        "",
        "| from | target | measured | wanted | | basis |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    profiled = {(p["scenario"], p["model"], p["protocol"], p["concurrency"]): p for p in run.get("profiles", ())}
    for t in targets(points):
        verdict = {True: "met", False: "**MISSED**", None: "n/a"}[t["met"]]
        if t["met"] is False and (point := one(points, *_model_first(t["at"]))) and "device_busy" in point:
            verdict += f" ({_batches(point)})"
        if t["met"] is False and (prof := profiled.get(t["at"])):
            verdict += f" ([profile]({prof['svg']}), [summary]({prof['txt']}))"
        digits = 2 if t["unit"] == "×" else 1
        value = "–" if t["value"] is None else shown(t["value"], t["op"], t["target"], t["met"], digits)
        op = "≥" if t["op"] == ">=" else "≤"
        lines.append(f"| {t['source']} | {t['what']} | {value} {t['unit']} | {op} {t['target']:g} {t['unit']} | {verdict} | {t['basis']} |")
    lines += [
        "", "## Side by side", "",
        "Each cell: **requests/s · server CPU ms per request · p99 ms**.",
        "¹ perf_analyzer needs Triton's model configuration extension, which MLServer and stock KServe lack:"
        " their gRPC figures are those of the tritonclient load.",
        "", *side_by_side(run), "", "![side by side](side_by_side.png)",
    ]
    if run.get("profiles"):
        lines += ["", "## Where kserve-ascend's CPU goes (py-spy)", "",
                  "Self samples by package (threads not idle) and by function (the thread holding the GIL: the Python work itself);"
                  " the `.txt` beside each flame graph has both views in full, per process and per line.", ""]
        for prof in run["profiles"]:
            busy, gil = prof["busy"], prof["gil"]
            packages = ", ".join(f"{name} {share:.0%}" for name, share in busy["packages"][:6])
            functions = "; ".join(f"`{name}` {share:.0%}" for name, share in gil["functions"][:6])
            lines += [f"- **{prof['scenario']}, {prof['model']}, {PROTOCOL_NAMES[prof['protocol']]}, c={prof['concurrency']}**"
                      f" ([flame graph]({prof['svg']}), [summary]({prof['txt']})). Busy threads ({busy['samples']} samples): {packages}."
                      f" Holding the GIL ({gil['samples']} samples): {functions}."]
    for model in dict.fromkeys(p["model"] for p in points):
        lines += [
            "", f"## {model}", "",
            "| scenario | protocol | c | requests/s | server CPU ms/req | p99 ms | mean ms | p50 ms | errors | batches | cores: server / load / others | server RSS MiB start → end |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
        ]
        for p in (p for p in points if p["model"] == model):
            rss = f"{p['rss_start_mb']:.0f} → {p['rss_end_mb']:.0f}" if "rss_start_mb" in p else ""
            noisy = " ⚠" if p["other_cores"] > NOISY_CORES else ""
            lines.append(
                f"| {p['scenario']} | {p['protocol']} | {p['concurrency']} | {_n(p['qps'])} | {_n(p.get('server_cpu_ms'), 3)} | {_n(p['p99_ms'])}"
                f" | {_n(p['mean_ms'])} | {_n(p['p50_ms'])} | {p['errors']} | {_batches(p) if 'device_busy' in p else ''} | {p['server_cores']:.2f} / {p['load_cores']:.2f} / {p['other_cores']:.2f}{noisy} | {rss} |"
            )
    lines += [
        "", "## Server memory", "",
        "RSS of the server process tree before a model's first point and after its last,"
        " and the largest change within one point. Tensors in flight grow with concurrency (yolov8n: 7.7 MB per request),"
        " and freed memory is not handed back to the system, so only a repeated load can tell a leak from a high-water mark.",
        "", "| scenario | model | RSS before | after | largest change in one point |", "| --- | --- | ---: | ---: | ---: |",
    ]
    for scenario in scenarios:
        for model in dict.fromkeys(p["model"] for p in points):
            measured = [p for p in points if p["scenario"] == scenario and p["model"] == model and "rss_start_mb" in p]
            if measured:
                change = max((p["rss_end_mb"] - p["rss_start_mb"] for p in measured), key=abs)
                lines.append(f"| {scenario} | {model} | {measured[0]['rss_start_mb']:.0f} MiB | {measured[-1]['rss_end_mb']:.0f} MiB | {change:+.0f} MiB |")
    return "\n".join(lines) + "\n"


def plot(run: dict, path: Path) -> None:
    points, scenarios = run["points"], list(run["scenarios"])
    models = list(dict.fromkeys(p["model"] for p in points))
    plt = _pyplot()
    from matplotlib import ticker

    colours = dict(zip(COLOURED, plt.get_cmap("tab10").colors))
    figure, axes = plt.subplots(len(models), 2, figsize=(13, 4.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        served = [p for p in points if p["model"] == model and p["scenario"] != "raw"]
        for scenario in scenarios:
            for protocol, (style, _) in PROTOCOL_STYLES.items():
                line = sorted(find(served, model, scenario, protocol), key=lambda p: p["concurrency"])
                if line:
                    c = [p["concurrency"] for p in line]
                    options = {"color": colours[scenario], "linestyle": style, "marker": "o", "label": f"{scenario} {protocol}"}
                    row[0].plot(c, [p["qps"] for p in line], **options)
                    row[1].plot(c, [p["p99_ms"] for p in line], **options)
        raw = max(find(points, model, "raw", "call"), key=lambda p: p["concurrency"], default=None)
        # A ceiling far above every server (simple's 16-int add) would flatten the plot: the table has it.
        if raw and served and raw["qps"] <= 10 * max(p["qps"] for p in served):
            row[0].axhline(raw["qps"], color=colours["raw"], linestyle=(0, (1, 5)), label=f"raw executor, batch {raw['concurrency']}")
        ticks = sorted({p["concurrency"] for p in served})
        for axis, title, unit in ((row[0], "throughput", "requests/s"), (row[1], "p99 latency", "ms (log)")):
            axis.set_title(f"{model}: {title}")
            axis.set_xscale("log")
            axis.set_xticks(ticks, [str(c) for c in ticks])
            axis.xaxis.set_minor_formatter(ticker.NullFormatter())
            axis.set_xlabel("concurrent clients")
            axis.set_ylabel(unit)
            axis.grid(True, which="both", alpha=0.3)
        row[0].set_ylim(bottom=0)
        row[1].set_yscale("log")
        row[1].yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
        row[1].yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        row[1].yaxis.set_minor_formatter(ticker.NullFormatter())
        row[0].legend(fontsize=7, loc="best", ncol=2)
    figure.suptitle(
        " · ".join(f"{name}: {PROTOCOL_NAMES[protocol]}" for protocol, (_, name) in PROTOCOL_STYLES.items())
        + " · horizontal: in-process executor",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_side_by_side(run: dict, path: Path) -> None:
    """Bars per server for each (load, concurrency): requests/s and server CPU ms per request, simple and fastsim."""
    points = run["points"]
    peers = [s for s in PEERS if s in run["scenarios"] and s not in run.get("skipped", {})]
    plt = _pyplot()
    colours = dict(zip(COLOURED, plt.get_cmap("tab10").colors))
    figure, axes = plt.subplots(len(SIDE_BY_SIDE_MODELS), 2, figsize=(14, 4.6 * len(SIDE_BY_SIDE_MODELS)), squeeze=False)
    width = 0.8 / max(len(peers), 1)
    for row, model in zip(axes, SIDE_BY_SIDE_MODELS):
        groups = [(p, c) for p in SIDE_BY_SIDE_LOADS for c in run["concurrency"].get(model, ())]
        for axis, key, title in ((row[0], "qps", "requests/s"), (row[1], "server_cpu_ms", "server CPU ms per request")):
            for i, scenario in enumerate(peers):
                values = [(one(points, model, scenario, p, c) or {}).get(key) for p, c in groups]
                x = [g + (i - (len(peers) - 1) / 2) * width for g in range(len(groups))]
                axis.bar(x, [v or 0 for v in values], width, color=colours[scenario], label=PEERS[scenario])
            axis.set_xticks(range(len(groups)), [f"{PROTOCOL_NAMES[p].replace(' (', chr(10) + '(')}\nc={c}" for p, c in groups], fontsize=7)
            axis.set_title(f"{model}: {title} (higher is better)" if key == "qps" else f"{model}: {title} (lower is better)")
            axis.grid(True, axis="y", alpha=0.3)
        row[0].legend(fontsize=8)
    figure.suptitle("Side by side, one run; missing bars: not measurable (perf_analyzer on MLServer / stock KServe) or not run", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(run: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(run, indent=1) + "\n")
    (out / "results.md").write_text(markdown(run))
    plot(run, out / "qps_p99.png")
    plot_side_by_side(run, out / "side_by_side.png")


if __name__ == "__main__":
    source = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "results.json")
    write(json.loads(source.read_text()), source.parent)
