"""An Open Inference Protocol v2 wire-protocol conformance suite, runnable against any server.

    python -m conformance --http HOST:PORT --grpc HOST:PORT [--target NAME] [--report FILE]

The server must serve the models of `conformance/models/` (identity models per datatype
and Triton's `simple`). Every case names the section of the OIP v2 specification
(KServe's docs/predict-api/v2/required_api.md) or of Triton's protocol extension
documents (docs/protocol/extension_*.md) that it checks.
"""
