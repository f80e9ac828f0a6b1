"""HTTP compression of inference requests and responses, as Triton's HTTP frontend does it.

Triton compresses the inference route only, both ways (server's src/http_server.cc:
HandleInfer, DecompressBuffer, GetResponseCompressionType, CompressionTypeUsed;
src/data_compressor.h):
- a request body with `Content-Encoding: gzip` or `deflate` is inflated before it is parsed
  (zlib tells the two apart by their header), so `Inference-Header-Content-Length` counts the
  inflated body; any other coding but identity is refused, naming the codings read in
  `Accept-Encoding` (Triton answers 501; this server 415, RFC 9110 §15.5.16);
- a successful response is compressed with the coding of highest q-value among gzip, deflate
  and identity in `Accept-Encoding` (deflate is the zlib format, as tritonclient writes and
  reads it); an error answer never is (tritonclient reads those uncompressed).
The inflated body is held to --http_max_input_size like a plain one: a body that inflates past
it is answered 413 as soon as it does, so a small "zip bomb" cannot exhaust memory.

The REST edge's inference route calls these (`rest.py`); no other route compresses.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib

from starlette.exceptions import HTTPException
from starlette.types import Message, Receive

CODINGS = ("gzip", "deflate")
#: zlib's default level (Z_DEFAULT_COMPRESSION), Triton's.
LEVEL = 6
#: A response body smaller than this is compressed on the event loop: it takes less time than
#: handing it to a thread. Larger ones (milliseconds of work) are compressed off the loop.
INLINE_BYTES = 4096


def response_coding(accept_encoding: str | None) -> str:
    """The coding of highest weight among identity, gzip and deflate; identity unless one weighs more than 0."""
    best, weight = "identity", 0.0
    for item in (accept_encoding or "").split(","):
        coding, _, parameters = item.partition(";")
        coding, parameters = coding.strip().lower(), parameters.strip()
        try:
            q = float(parameters[2:]) if parameters.startswith("q=") else 1.0
        except ValueError:
            continue  # a malformed weight: the entry is skipped, as Triton does
        if coding in ("identity", *CODINGS) and q > weight:
            best, weight = coding, q
    return best


def compress(body: bytes, coding: str) -> bytes:
    return gzip.compress(body, LEVEL, mtime=0) if coding == "gzip" else zlib.compress(body, LEVEL)


async def compressed(body: bytes, coding: str) -> bytes:
    """`body` compressed with `coding`: a small one on the event loop, a large one off it."""
    return compress(body, coding) if len(body) < INLINE_BYTES else await asyncio.to_thread(compress, body, coding)


def decoding(receive: Receive, content_encoding: str | None, limit: int) -> Receive:
    """The request body as the endpoint reads it: inflated (gzip, deflate), as sent (identity), or refused.

    Failures raise HTTPException, which the edge answers in the OIP error shape.
    """
    coding = (content_encoding or "").strip().lower() or "identity"
    if coding in CODINGS:
        return _inflating(receive, coding, limit)
    if coding != "identity":
        return _refusing(coding)
    return receive


def _refusing(coding: str) -> Receive:
    """A body that is never read: its coding is not one this server reads."""

    async def refusing_receive() -> Message:
        raise HTTPException(
            415, f"unsupported Content-Encoding '{coding}': a request body may be gzip, deflate or identity",
            headers={"Accept-Encoding": ", ".join(CODINGS)},
        )

    return refusing_receive


def _inflating(receive: Receive, coding: str, limit: int) -> Receive:
    # wbits 15 | 32: a gzip or a zlib stream, told apart by its header (Triton's inflateInit2(15 | 32)).
    inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)
    size = 0

    async def inflating_receive() -> Message:
        nonlocal size
        message = await receive()
        if message["type"] != "http.request":
            return message
        try:
            # At most one byte past the limit: what shows it is passed, without inflating the rest.
            # Off the event loop: a small chunk may inflate to many megabytes.
            body = await asyncio.to_thread(inflater.decompress, message.get("body", b""), limit + 1 - size)
        except zlib.error as error:
            raise HTTPException(400, f"the request body is not valid {coding} data: {error}") from None
        size += len(body)
        if size > limit:
            raise HTTPException(413, f"the request body inflates to more than {limit} bytes (--http_max_input_size)")
        if inflater.unused_data:
            raise HTTPException(400, f"the request body goes on after the end of its {coding} data")
        if not message.get("more_body", False) and not inflater.eof:
            raise HTTPException(400, f"the request body ends before the end of its {coding} data")
        return {**message, "body": body}

    return inflating_receive
