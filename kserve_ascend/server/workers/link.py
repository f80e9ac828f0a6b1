"""The engine's end of one frontend's channel (`--workers N`): the inferences and calls it sends, served by the
engine's data plane on the engine's loop, and the shared memory both sides write.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Callable, Iterable

import numpy as np
from opentelemetry import context as otel_context
from opentelemetry import propagate

from ...core import datatypes
from ...core.stats import RequestTiming, now_ns
from ..dataplane import InferRequest, ResponseStream
from ..dataplane.local import LocalDataPlane
from ..observability import logs
from . import messages
from .arena import Arena, Mapped, write
from .channel import Channel
from .remote import FORWARDED

log = logging.getLogger(__name__)


class FrontendLink:
    """Serves one frontend's messages; `serving()` once the frontend says it listens."""

    def __init__(self, dataplane: LocalDataPlane, sock: socket.socket, serving: Callable[[], None]):
        self.dataplane = dataplane
        self.serving = serving
        self.channel = Channel(sock, self._received, self._closed)
        self.inputs = Mapped(lambda block: self.channel.send(messages.Free(block.segment, block.offset)))  # the frontend's arena
        self.outputs = Arena(self.channel.send)  # the answers', written here
        self.tasks: dict[int, asyncio.Task] = {}
        #: Inferences answered, whose statistics await the time the frontend spent encoding them: call ->
        #: (their timing, the time the engine spent on their answer).
        self.answered: dict[int, tuple[RequestTiming, int]] = {}

    def start(self, greeting: Iterable[tuple[messages.Message, int | None]]) -> None:
        """Starts serving, and sends the frontend what it must know before it serves (messages and their descriptors)."""
        self.channel.start()
        self.channel.send(messages.Hello(messages.VERSION))
        for message, fd in greeting:
            self.channel.send(message, fd)

    def close(self) -> None:
        self.channel.close()
        self.inputs.close()
        self.outputs.close()

    def _closed(self) -> None:
        # The frontend is gone: nobody waits for its requests any more, nor has one had the answers it was sent.
        for task in list(self.tasks.values()):
            task.cancel()
        for timing, _ in self.answered.values():
            timing.answered(False)
        self.answered.clear()

    def _received(self, message: messages.Message) -> None:
        kind = type(message)
        if kind is messages.Infer:
            self._spawn(message.call, self._infer(message))
        elif kind is messages.Done:
            entry = self.answered.pop(message.call, None)
            if entry is not None and message.answered is not None:  # None: its client left, counted nowhere
                timing, made_ns = entry
                timing.answered(message.answered, made_ns + message.answer_ns)
            elif entry is not None and entry[0].trace is not None:  # but its trace ends, for trace_count's file
                entry[0].trace.end(entry[0], now_ns())
        elif kind is messages.Free:
            self.outputs.free(message.segment, message.offset)
        elif kind is messages.Call:
            self._spawn(message.call, self._call(message))
        elif kind is messages.Cancel:
            task = self.tasks.get(message.call)
            if task is not None:
                # After its first step (queued before this): a task cancelled before it starts would neither
                # answer nor free the inputs the frontend wrote for it.
                asyncio.get_running_loop().call_soon(task.cancel)
        elif kind is messages.Segment:
            self.inputs.add(message.number, message.size, self.channel.take_fd())
        elif kind is messages.Drop:
            self.inputs.drop(message.number)
        elif kind is messages.Serving:
            self.serving()
        elif kind is messages.Hello:
            refusal = messages.mismatch(message, "frontend")
            if refusal is not None:
                log.error("%s", refusal)
                self.channel.close()

    def _spawn(self, call: int, work) -> None:
        task = asyncio.create_task(work)
        self.tasks[call] = task
        task.add_done_callback(lambda _, call=call: self.tasks.pop(call, None))

    async def _infer(self, message: messages.Infer) -> None:
        """An inference: `Inferred`, or (a decoupled model's, `streaming`) `Streaming` once it is taken, then its
        responses (`_stream`)."""
        logs.begin_request(message.log_id)
        token = otel_context.attach(propagate.extract(message.trace)) if message.trace is not None else None
        try:
            request = InferRequest(
                message.model_name, self._tensors(message.block, message.inputs), message.model_version, message.id,
                tuple(message.outputs), message.parameters, message.classification, message.received_ns, message.protocol,
            )
            answer = await self.dataplane.infer(request, message.streaming)
            del request  # its inputs: the frontend may reuse their memory once the last array over it is gone
            if answer.streamed:
                self.channel.send(messages.Streaming(message.call, answer.model_name, answer.model_version))
                return await self._stream(message.call, answer)
            timing = answer.timing
            try:
                block, outputs = write(self.outputs, answer.outputs.items())
            except BaseException:
                timing.answered(False)
                raise
            self.answered[message.call] = timing, now_ns() - timing.answer_start
            self.channel.send(messages.Inferred(message.call, answer.model_name, answer.model_version, block, outputs))
        except asyncio.CancelledError:
            self.channel.send(messages.Failed(message.call, "cancelled", "the client went away"))
        except Exception as error:  # a fault is logged by the frontend's edge, with this traceback
            self.channel.send(messages.failure(message.call, error))
        finally:
            if token is not None:
                otel_context.detach(token)

    async def _stream(self, call: int, responses: ResponseStream) -> None:
        """A decoupled model's responses: a `Response` each, then `Final`; a `Cancel` from the frontend (its client
        left) cancels this, which stops the model producing. Answers every error itself."""
        try:
            async for outputs in responses:
                block, tensors = write(self.outputs, outputs.items())
                self.channel.send(messages.Response(call, block, tensors))
            self.channel.send(messages.Final(call))
        except asyncio.CancelledError:
            pass  # its client left: nobody reads what would follow
        except Exception as error:
            self.channel.send(messages.failure(call, error))
        finally:
            await responses.aclose()

    def _tensors(self, block: messages.Block | None, tensors: list[messages.Tensor]) -> dict[str, np.ndarray]:
        """The request's inputs, in its order: in the frontend's arena, or in a registered shared memory region."""
        in_arena = self.inputs.tensors(block, [tensor for tensor in tensors if tensor.region is None])
        arrays = {}
        for tensor in tensors:
            if tensor.region is None:
                arrays[tensor.name] = in_arena[tensor.name]
            else:
                view = self.dataplane.regions.view(tensor.region, tensor.offset, tensor.nbytes, f"input '{tensor.name}'")
                arrays[tensor.name] = np.frombuffer(view.toreadonly(), datatypes.to_numpy(tensor.datatype)).reshape(tensor.shape)
        return arrays

    async def _call(self, message: messages.Call) -> None:
        try:
            if message.method not in FORWARDED:
                raise AttributeError(f"the data plane has no method '{message.method}'")
            value = await getattr(self.dataplane, message.method)(*message.args)
        except asyncio.CancelledError:
            self.channel.send(messages.Failed(message.call, "cancelled", "the caller went away"))
        except Exception as error:
            self.channel.send(messages.failure(message.call, error))
        else:
            self.channel.send(messages.Returned(message.call, value))
