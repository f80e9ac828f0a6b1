"""The tail at c=64 over JSON (hey): the server as it is, without its settled heap, and without the garbage collector."""
import json, shutil, subprocess, sys, tempfile, time, socket, requests, re
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
def run(pre, c=64, secs=6):
    hp, gp, mp = port(), port(), port()
    code = f"import gc, runpy, sys; {pre}; sys.argv=['kserve_ascend','--model_dir','{REPO}','--model_control_mode','explicit','--load_model','simple','--http_port','{hp}','--grpc_port','{gp}','--metrics_port','{mp}']; runpy.run_module('kserve_ascend', run_name='__main__')"
    p = subprocess.Popen([PY, "-c", code], cwd=ROOT, stdout=open(REPO / "server.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{hp}"
    for _ in range(600):
        try:
            if requests.get(url + "/v2/models/simple/ready", timeout=1).status_code == 200: break
        except requests.ConnectionError: pass
        time.sleep(0.1)
    infer = url + "/v2/models/simple/infer"
    hey = ["hey", "-c", str(c), "-m", "POST", "-T", "application/json", "-D", str(BODY), "-disable-compression"]
    subprocess.run(hey + ["-z", "2s", infer], capture_output=True)
    out = subprocess.run(hey + ["-z", f"{secs}s", infer], capture_output=True, text=True).stdout
    p.terminate(); p.wait(30)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    d = dict(re.findall(r"(\d+)% in ([\d.]+) secs", out))
    return rps, float(d["50"]) * 1000, float(d["99"]) * 1000
#: The server as it is (it settles its heap, kserve_ascend/core/heap.py), without that, and without the collector.
UNSETTLED = "import kserve_ascend.core.heap as heap; heap.settle = lambda what: 0"
VARIANTS = [("settled", "pass"), ("unsettled", UNSETTLED), ("gc off", UNSETTLED + "; gc.disable()")] * 2
for label, pre in VARIANTS:
    rps, p50, p99 = run(pre)
    print(f"{label:9s} {rps:7.0f}/s p50 {p50:5.1f} p99 {p99:5.1f} ms", flush=True)
