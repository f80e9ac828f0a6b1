"""perf_analyzer (gRPC, c=16 and c=64) against each mode of floor.py, or kserve-ascend itself (`server`): requests/s, p99, server CPU per request."""
import json, shutil, subprocess, sys, tempfile, time, socket, psutil, re
from pathlib import Path
def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
PA = str(ROOT / ".venv" / "bin" / "perf_analyzer")
#: model_repository's `simple` with dynamic batching, as bench/run.py serves it.
REPO = Path(tempfile.mkdtemp(prefix="grpc-floor-"))
shutil.copytree(ROOT / "model_repository" / "simple", REPO / "simple")
with open(REPO / "simple" / "config.pbtxt", "a") as config:
    config.write("dynamic_batching { }\n")
BODY = REPO / "body.json"
BODY.write_text(json.dumps({"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))} for n in ("INPUT0", "INPUT1")]}))
def measure(cmd, grpc_port, c, secs=4):
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if "kserve_ascend" not in " ".join(cmd):
        srv.stdout.readline()
    else:
        time.sleep(8)
    proc = psutil.Process(srv.pid)
    def cpu():
        return sum(sum(q.cpu_times()[:2]) for q in [proc, *proc.children(recursive=True)])
    args = [PA, "-m", "simple", "-i", "grpc", "-u", f"127.0.0.1:{grpc_port}", "--concurrency-range", str(c),
            "--measurement-interval", str(secs * 1000), "--max-trials", "3", "--stability-percentage", "10000"]
    c0 = cpu(); t0 = time.time()
    out = subprocess.run(args, capture_output=True, text=True).stdout
    c1 = cpu(); t1 = time.time()
    srv.terminate(); srv.wait(20)
    tput = float(re.search(r"Throughput: ([\d.]+) infer/sec", out).group(1))
    p99 = float(re.search(r"p99 latency: (\d+) usec", out).group(1)) / 1000
    # perf_analyzer runs ~3 windows + warm-up: CPU over the whole wall time, requests at the measured rate
    return tput, p99, (c1 - c0) / (tput * (t1 - t0)) * 1000
if __name__ == "__main__":
    for mode in sys.argv[1:]:
        for c in (16, 64):
            gp = port()
            if mode == "server":
                hp = port(); mp = port()
                cmd = [PY, "-m", "kserve_ascend", "--model_dir", str(REPO), "--model_control_mode", "explicit", "--load_model", "simple",
                       "--http_port", str(hp), "--grpc_port", str(gp), "--metrics_port", str(mp)]
            else:
                cmd = [PY, str(ROOT / "bench" / "grpc_floor" / "floor.py"), *mode.split(":"), str(gp)] if ":" not in mode else [PY, str(ROOT / "bench" / "grpc_floor" / "floor.py"), mode.split(":")[0], str(gp), "--threads", mode.split(":")[1]]
            t, p, cp = measure(cmd, gp, c)
            print(f"{mode:10s} c={c:3d} {t:8.0f}/s p99 {p:6.1f} ms cpu {cp:.3f} ms/req", flush=True)
