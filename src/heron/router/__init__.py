"""``heron router``: an OpenAI-compatible front door over engine replicas that
sends each request where its prefix is cached, away from overloaded or dead
replicas (docs/architecture.md)."""
