"""The ``heron`` command and the OpenAI-compatible server (docs/architecture.md,
"The path of a request")."""
