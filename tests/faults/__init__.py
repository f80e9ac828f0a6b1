"""Fault injection: which faults the server survives, and how it answers each (issue 18).

Every test here starts real server processes, one process and `--workers 2` (an engine and two
frontends), and injects the fault as it would happen: a signal, a busy port, a client that leaves,
a body too big for the event loop, a model that breaks its batch, more connections than the queue
admits, a device error through the FAKE pyACL module. Each module's docstring lists its faults as
"fault -> answer".

| fault | answer | module |
| --- | --- | --- |
| SIGTERM under load | unready at once, live; new requests 503 / UNAVAILABLE; every accepted request answered; exit 0 within `--shutdown_timeout_s` | test_shutdown |
| SIGTERM under clients that open a connection per request | each connection the kernel accepted answered 200 or 503 before the HTTP port closes, the later ones refused: none reset | test_shutdown |
| a request still running at the shutdown timeout | 503 / UNAVAILABLE "not answered within the shutdown timeout"; exit 0 | test_shutdown |
| HTTP, gRPC or metrics port busy; a second server on our gRPC port | exit 1 with one line naming the port, no traceback | test_ports |
| relative `--model_dir` (poll, none, explicit) | serves; poll mode loads what is copied in | test_paths |
| HTTP client disconnects, gRPC cancel or deadline, while queued | leaves the queue, counted CANCELED | test_cancel |
| the client leaves while its batch executes | the batch finishes; the answer is dropped, counted CANCELED | test_cancel |
| a 23 MB JSON body (and answer) | decoded and encoded off the event loop: probes answered < 100 ms | test_loop |
| a model that loses rows, a runner that answers wrongly or raises BaseException, a fault while forming, queueing or answering a batch | 500 / INTERNAL for the requests concerned; the scheduler serves on | test_scheduler |
| 1,000 concurrent connections | 200 or 503 "Exceeds maximum queue size"; no 500, memory bounded | test_overload |
| a timeout the queue ahead cannot meet | refused on arrival: 503 / UNAVAILABLE "cannot be served within its timeout" | test_overload |
| an execution error, a fatal device error on one of two instances | 500 for that batch only; a fatal error takes the instance out of rotation, the other serves | test_device |

Statuses a client should retry (elsewhere, after a backoff): 503 / UNAVAILABLE.
"""
