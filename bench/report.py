"""The bench's outputs from its raw numbers: results.json, results.md and qps_p99.png.

    python bench/report.py bench/results/results.json   # re-renders results.md and the plot

Ratios compare peak throughput (the best concurrency of each side) unless they name one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

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


def find(points, model, scenario, protocol, concurrency=None) -> list[dict]:
    return [
        p for p in points
        if p["model"] == model and p["scenario"] == scenario and p["protocol"] == protocol
        and (concurrency is None or p["concurrency"] == concurrency)
    ]


def peak(points, model, scenario, protocol) -> dict | None:
    found = find(points, model, scenario, protocol)
    return max(found, key=lambda p: p["qps"]) if found else None


def targets(points: list[dict]) -> list[dict]:
    """Each target of the brief: what was measured, against what, and whether it is met."""
    rows = []

    def add(what, value, op, target, unit, basis):
        met = None if value is None else (value >= target if op == ">=" else value <= target)
        rows.append({"what": what, "value": value, "op": op, "target": target, "unit": unit, "met": met, "basis": basis})

    def ratio(a, b):
        return a["qps"] / b["qps"] if a and b and b["qps"] else None

    def at(p, key):
        return p[key] if p else None

    for protocol in ("http", "grpc"):
        batch = next(iter(find(points, "sim", "batch", protocol, 10)), None)
        plain = next(iter(find(points, "sim", "nobatch", protocol, 10)), None)
        basis = f"c=10, {PROTOCOL_NAMES[protocol]}"
        add(f"sim: batching ÷ no batching ({protocol})", ratio(batch, plain), ">=", 5.7, "×", basis)
        add(f"sim: batching mean latency ({protocol})", at(batch, "mean_ms"), "<=", 37, "ms", basis)
        add(f"sim: batching p99 latency ({protocol})", at(batch, "p99_ms"), "<=", 60, "ms", basis)
    raw = max(find(points, "yolov8n", "raw", "call"), key=lambda p: p["concurrency"], default=None)  # at max_batch_size
    yolo = peak(points, "yolov8n", "batch", "grpc")
    add("yolov8n: kserve_ascend batching ÷ raw executor", ratio(yolo, raw), ">=", 0.90, "×", "peak gRPC QPS ÷ rows/s at max_batch_size")
    add("yolov8n: kserve_ascend batching ÷ Triton", ratio(yolo, peak(points, "yolov8n", "triton", "grpc")), ">=", 1.0, "×", "peak gRPC QPS")
    # Each comparison under one load generator: stock KServe's gRPC load is tritonclient's (perf_analyzer cannot drive it).
    for baseline, target, protocols in (("stock", 2.0, ("http", "grpc-py")), ("triton", 0.5, ("http", "grpc"))):
        for protocol in protocols:
            mine = peak(points, "simple", "batch", protocol)
            name = "stock KServe" if baseline == "stock" else "Triton"
            add(f"simple: kserve_ascend ÷ {name} ({protocol})", ratio(mine, peak(points, "simple", baseline, protocol)), ">=", target, "×", f"peak QPS, {PROTOCOL_NAMES[protocol]}")
    return rows


def _n(value, digits=1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def markdown(run: dict) -> str:
    points, scenarios = run["points"], run["scenarios"]
    lines = [
        "# kserve-ascend bench",
        "",
        f"{run['date']} · {run['machine']} · {run['duration_s']:g} s measured per point after {run['warmup_s']:g} s of the same load"
        f" · whole run {run['seconds'] / 60:.1f} min · code at {run['code']} · closed loop, client and server on the same cores, loopback only.",
        "",
        "Scenarios: " + "; ".join(f"**{key}** = {label}" for key, label in scenarios.items()) + ".",
        f"`simple` in the batching repository (kserve_ascend batching and Triton): `{run['simple_batching']}`. "
        "A raw row's concurrency is its batch size, its QPS rows/s, its latency that of one batch.",
        "Cores: mean cores used during the point (warm-up and window) by the server process tree, by the load"
        f" generator (for raw: the executor), and by everything else on the machine; ⚠ marks points where others"
        f" took more than {NOISY_CORES} of a core. Server CPU ms/req = server cores ÷ QPS.",
        "",
        "## Targets",
        "",
        "| target | measured | wanted | | basis |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    for t in targets(points):
        verdict = {True: "PASS", False: "**MISS**", None: "n/a"}[t["met"]]
        digits = 2 if t["unit"] == "×" else 1
        lines.append(f"| {t['what']} | {_n(t['value'], digits)} {t['unit']} | {t['op']} {t['target']:g} {t['unit']} | {verdict} | {t['basis']} |")
    for model in dict.fromkeys(p["model"] for p in points):
        lines += [
            "", f"## {model}", "",
            "| scenario | protocol | c | QPS | mean ms | p50 ms | p99 ms | errors | cores: server / load / others | server CPU ms/req | server RSS MiB start → end |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |",
        ]
        for p in (p for p in points if p["model"] == model):
            rss = f"{p['rss_start_mb']:.0f} → {p['rss_end_mb']:.0f}" if "rss_start_mb" in p else ""
            noisy = " ⚠" if p["other_cores"] > NOISY_CORES else ""
            lines.append(
                f"| {p['scenario']} | {p['protocol']} | {p['concurrency']} | {_n(p['qps'])} | {_n(p['mean_ms'])} | {_n(p['p50_ms'])}"
                f" | {_n(p['p99_ms'])} | {p['errors']} | {p['server_cores']:.2f} / {p['load_cores']:.2f} / {p['other_cores']:.2f}{noisy}"
                f" | {_n(p.get('server_cpu_ms'), 2)} | {rss} |"
            )
    lines += [
        "", "## Server memory", "",
        "RSS of the server process tree before a model's first point and after its last (concurrency 1, 10, 64 in turn),"
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
    colours = dict(zip(scenarios, plt.get_cmap("tab10").colors))
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
        for axis, title, unit in ((row[0], "throughput", "requests/s"), (row[1], "p99 latency", "ms (log)")):
            axis.set_title(f"{model}: {title}")
            axis.set_xscale("log")
            axis.set_xticks(run["concurrency"], [str(c) for c in run["concurrency"]])
            axis.set_xlabel("concurrent clients")
            axis.set_ylabel(unit)
            axis.grid(True, which="both", alpha=0.3)
        row[0].set_ylim(bottom=0)
        row[1].set_yscale("log")
        row[1].yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        row[1].yaxis.set_minor_formatter(ticker.NullFormatter())
        row[0].legend(fontsize=8, loc="best")
    figure.suptitle(
        " · ".join(f"{name}: {PROTOCOL_NAMES[protocol]}" for protocol, (_, name) in PROTOCOL_STYLES.items())
        + " · horizontal: in-process executor",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(run: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(run, indent=1) + "\n")
    (out / "results.md").write_text(markdown(run))
    plot(run, out / "qps_p99.png")


if __name__ == "__main__":
    source = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "results.json")
    write(json.loads(source.read_text()), source.parent)
