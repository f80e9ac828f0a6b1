"""The executor core both servers share: it imports neither kserve nor Triton's `pb_utils`.

- `config`, `signature`, `datatypes`, `errors`: a model's description and the words for what goes wrong;
- `contracts`: what the servers rely on (a served version, a request scheduler, request options, health);
- `models/`: versions (plain and ensemble), models and the repository with its lifecycle;
- `scheduling/`: dynamic batching, sequence batching and their queues;
- `execution/`: an instance (a model file on a device), its warmup and runtimes (pyACL, ONNX Runtime, sim);
- `stats`, `tracing`: Triton's statistics extension and OpenTelemetry spans.
"""
