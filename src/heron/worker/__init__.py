"""The model runner and what it keeps per request and per step: flat-batch
inputs, sampling metadata, block tables, KV-cache sizing, CUDA graphs
(docs/architecture.md, "Layers")."""
