"""A DELIBERATELY BROKEN OIP server for testing the conformance suite: it must catch these faults.

A REST proxy in front of a correct server that breaks four behaviours on purpose:
client errors come back as 500, the request `id` is dropped from infer responses,
model metadata reports the wrong shape for inputs, and every value `simple` answers (JSON
or binary) is one more than it should be. Everything else passes through.

    python tests/broken_oip_server.py --upstream HOST:PORT --port PORT
"""

import argparse

import httpx
import numpy as np
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def one_more(body: bytes, header_length: int | None) -> bytes:
    """`simple`'s answer with every value one more: its outputs are INT32, in JSON or after the header."""
    if header_length is not None:
        values = np.frombuffer(body[header_length:], np.int32) + 1
        return body[:header_length] + values.tobytes()
    payload = orjson.loads(body)
    for output in payload["outputs"]:
        output["data"] = [value + 1 for value in output.get("data", [])]
    return orjson.dumps(payload)


def build(upstream: str) -> Starlette:
    client = httpx.AsyncClient(base_url=f"http://{upstream}")

    async def proxy(request: Request) -> Response:
        answer = await client.request(
            request.method, request.url.path, content=await request.body(),
            headers={k: v for k, v in request.headers.items() if k.lower() in ("content-type", "inference-header-content-length")},
        )
        body, status = answer.content, answer.status_code
        headers = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "inference-header-content-length")}
        path = request.url.path
        if path.endswith("/infer") and 400 <= status < 500:
            status = 500  # fault 1: client mistakes answered as server errors
        elif path.endswith("/infer") and status == 200:
            binary = "inference-header-content-length" in headers
            if path.startswith("/v2/models/simple/"):
                body = one_more(body, int(headers["inference-header-content-length"]) if binary else None)  # fault 4
            if not binary:
                payload = orjson.loads(body)
                payload.pop("id", None)  # fault 2: the request id is not echoed
                body = orjson.dumps(payload)
        elif request.method == "GET" and path.count("/") == 3 and path.startswith("/v2/models/") and status == 200:
            payload = orjson.loads(body)
            for tensor in payload.get("inputs", []):
                tensor["shape"] = tensor["shape"][1:]  # fault 3: the batch dimension is missing
            body = orjson.dumps(payload)
        return Response(body, status_code=status, headers=headers)

    return Starlette(routes=[Route("/{path:path}", proxy, methods=["GET", "POST"])])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(build(args.upstream), host="127.0.0.1", port=args.port, log_level="warning")
