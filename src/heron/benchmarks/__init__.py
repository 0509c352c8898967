"""``heron bench``: load generation against any OpenAI-compatible server,
offline throughput and latency, datasets and reports."""
