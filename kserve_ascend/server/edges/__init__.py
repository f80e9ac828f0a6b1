"""The protocol edges: REST and gRPC (OIP v2), KServe's V1 routes and `predict`, the wire codecs, compression, authentication."""
