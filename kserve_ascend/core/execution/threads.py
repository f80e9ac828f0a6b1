"""The thread an instance runs on in the KServe server: device contexts (ACL's) are bound to a thread."""

from __future__ import annotations

import concurrent.futures
import queue
import threading


class InstanceThread(concurrent.futures.Executor):
    """The one thread an instance runs on, calls in submission order (device contexts are thread-bound).

    A daemon thread, unlike ThreadPoolExecutor's workers, which the interpreter joins at exit:
    a device call that never returns must not hold the process when it stops. `abandon` marks
    a thread stuck in such a call, so that releasing its instance does not wait for it.
    """

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:
                    future.set_exception(error)
            del call, future  # not kept alive while waiting for the next call

    def abandon(self) -> None:
        self.abandoned = True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._calls.put(None)
        if wait and not self.abandoned:
            self._thread.join()
