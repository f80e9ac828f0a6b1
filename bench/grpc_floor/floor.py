"""The floor of each way of driving grpcio: a servicer that answers `simple` (add/sub of two INT32[1,16])."""
import argparse, asyncio, sys
from concurrent import futures
import numpy as np, grpc
from grpc import aio
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc, model_config_pb2 as mc

CONFIG = mc.ModelConfig(name="simple", max_batch_size=8,
    input=[mc.ModelInput(name=n, data_type=mc.TYPE_INT32, dims=[16]) for n in ("INPUT0", "INPUT1")],
    output=[mc.ModelOutput(name=n, data_type=mc.TYPE_INT32, dims=[16]) for n in ("OUTPUT0", "OUTPUT1")])
META = pb.ModelMetadataResponse(name="simple", versions=["1"], platform="ascend",
    inputs=[pb.ModelMetadataResponse.TensorMetadata(name=n, datatype="INT32", shape=[-1, 16]) for n in ("INPUT0", "INPUT1")],
    outputs=[pb.ModelMetadataResponse.TensorMetadata(name=n, datatype="INT32", shape=[-1, 16]) for n in ("OUTPUT0", "OUTPUT1")])

def infer(request):
    a = np.frombuffer(request.raw_input_contents[0], np.int32); b = np.frombuffer(request.raw_input_contents[1], np.int32)
    out = pb.ModelInferResponse(model_name="simple", model_version="1", id=request.id,
        outputs=[pb.ModelInferResponse.InferOutputTensor(name=n, datatype="INT32", shape=[1, 16]) for n in ("OUTPUT0", "OUTPUT1")])
    out.raw_output_contents.extend([(a + b).tobytes(), (a - b).tobytes()])
    return out

class Sync(rpc.GRPCInferenceServiceServicer):
    def ServerMetadata(self, r, c): return pb.ServerMetadataResponse(name="floor", version="1", extensions=[])
    def ServerLive(self, r, c): return pb.ServerLiveResponse(live=True)
    def ServerReady(self, r, c): return pb.ServerReadyResponse(ready=True)
    def ModelReady(self, r, c): return pb.ModelReadyResponse(ready=True)
    def ModelMetadata(self, r, c): return META
    def ModelConfig(self, r, c): return pb.ModelConfigResponse(config=CONFIG)
    def ModelInfer(self, r, c): return infer(r)

import threading, queue as _q
WORK = _q.SimpleQueue()
def _worker():
    while True:
        fn, done = WORK.get()
        done(fn())
threading.Thread(target=_worker, daemon=True).start()

class SyncHop(Sync):
    def ModelInfer(self, r, c):
        box, ev = [], threading.Event()
        WORK.put((lambda: infer(r), lambda v: (box.append(v), ev.set())))
        ev.wait(); return box[0]

LOOP = asyncio.new_event_loop()
threading.Thread(target=LOOP.run_forever, daemon=True).start()

async def hop_infer(r):
    loop = asyncio.get_running_loop(); fut = loop.create_future()
    WORK.put((lambda: infer(r), lambda v: loop.call_soon_threadsafe(fut.set_result, v)))
    return await fut

class SyncLoop(Sync):
    def ModelInfer(self, r, c):
        return asyncio.run_coroutine_threadsafe(hop_infer(r), LOOP).result()

class Async(rpc.GRPCInferenceServiceServicer):
    async def ServerMetadata(self, r, c): return pb.ServerMetadataResponse(name="floor", version="1", extensions=[])
    async def ServerLive(self, r, c): return pb.ServerLiveResponse(live=True)
    async def ServerReady(self, r, c): return pb.ServerReadyResponse(ready=True)
    async def ModelReady(self, r, c): return pb.ModelReadyResponse(ready=True)
    async def ModelMetadata(self, r, c): return META
    async def ModelConfig(self, r, c): return pb.ModelConfigResponse(config=CONFIG)
    async def ModelInfer(self, r, c):
        if not HOP:  # set below, from the mode
            return infer(r)
        loop = asyncio.get_running_loop(); fut = loop.create_future()
        WORK.put((lambda: infer(r), lambda v: loop.call_soon_threadsafe(fut.set_result, v)))
        return await fut

#: Each way of driving grpcio, and its servicer: the answer made in the handler, or on another thread
#: ("hop", as our instance threads make it), or in an asyncio loop that hops to that thread ("loop": our data plane's shape).
SYNC = {"sync": Sync, "synchop": SyncHop, "syncloop": SyncLoop}
ASYNC = ("aio", "aiohop", "uvloop")

p = argparse.ArgumentParser()
p.add_argument("mode", choices=[*SYNC, *ASYNC])
p.add_argument("port", type=int)
p.add_argument("--threads", type=int, default=4, help="the sync server's thread pool")
a = p.parse_args()
HOP = a.mode == "aiohop"
if a.mode in SYNC:
    s = grpc.server(futures.ThreadPoolExecutor(a.threads)); rpc.add_GRPCInferenceServiceServicer_to_server(SYNC[a.mode](), s)
    s.add_insecure_port(f"127.0.0.1:{a.port}"); s.start(); s.wait_for_termination()
else:
    async def main():
        s = aio.server(); rpc.add_GRPCInferenceServiceServicer_to_server(Async(), s)
        s.add_insecure_port(f"127.0.0.1:{a.port}"); await s.start(); await s.wait_for_termination()
    if a.mode == "uvloop":
        import uvloop; uvloop.install()
    asyncio.run(main())
