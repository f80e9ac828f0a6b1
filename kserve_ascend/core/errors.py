"""Typed errors of the executor core.

Each protocol edge maps these once to an HTTP status and a gRPC code; nothing below
the edges knows about either. `str(error)` is the message a client sees.
"""


class AscendError(Exception):
    """Base of every error the core raises on purpose."""


class InvalidInput(AscendError):
    """The request is malformed or does not match the model (a client mistake)."""


class ModelNotFound(AscendError):
    """No model, or no such version of it, is in the repository."""


class ModelNotReady(AscendError):
    """The model exists but is not loaded (it failed to load, or is still loading)."""


class Unavailable(AscendError):
    """The request cannot be served now: its queue is full or it timed out waiting (retry later)."""


class Unsupported(AscendError):
    """The server does not do what the request asks, on purpose (Triton's UNSUPPORTED: 501 / UNIMPLEMENTED): e.g.
    a decoupled model asked for one answer, as Triton refuses it on its unary routes."""


class ModelLoadError(AscendError):
    """A model could not be loaded: bad config, missing or corrupt file, missing runtime."""


class DeviceError(AscendError):
    """A device call failed; names the call and its return code.

    `fatal`: the failure leaves the instance's device context unusable (an AI Core
    exception, a lost device, an execution that never returned), so the instance is
    taken out of rotation until the model is reloaded; other device errors fail only
    the batch they happened in.
    """

    def __init__(self, call: str, ret: int, detail: str = "", fatal: bool = False):
        self.call = call
        self.ret = ret
        self.fatal = fatal
        super().__init__(f"{call} failed with return code {ret}" + (f": {detail}" if detail else ""))


class InternalError(AscendError):
    """A fault of the server or of a runtime that broke its contract (500 / INTERNAL): it fails the
    requests it concerns and no other; whoever catches it logs it with its cause."""
