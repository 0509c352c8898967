"""Where a request goes among engines: routing policies, circuit breakers, and
per-engine KV-block indexes kept from KV-cache events. Shared by ``heron router``
(replicas by URL) and ``--data-parallel-size`` (engine cores behind one API
server); imports only the core layer."""
