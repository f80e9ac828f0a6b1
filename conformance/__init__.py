"""An Open Inference Protocol v2 wire-protocol conformance suite, runnable against any server.

    python -m conformance --serve {kserve-ascend,triton}     [--report FILE] [pytest args]
    python -m conformance --http HOST:PORT --grpc HOST:PORT  [--target NAME] [--report FILE] [pytest args]

`--serve` starts a server of this project on `conformance/models/` with the flags the suite
needs, and stops it after the run. A server you run yourself must serve every model of
`conformance/models/` (version 1 of each, all loaded: Triton's `--model-control-mode=explicit
--load-model=*`), and, if it declares the `model_repository` extension, let clients unload and
load them: the suite unloads and reloads `identity_int8`. Each extension case runs only when the
server declares that extension in its metadata (`GET /v2`); otherwise the report says "not
declared", which is no failure. Every case names the section of the OIP v2 specification
(KServe's docs/predict-api/v2/required_api.md) or of Triton's protocol extension documents
(docs/protocol/extension_*.md) that it checks.
"""
