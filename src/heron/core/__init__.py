"""The scheduler and the paged KV cache (block pool, prefix cache): the one
scheduling rule of docs/architecture.md. Imports only the base layer and
structured output."""
