"""``heron serve``: the gateway, the routes, and the OpenAI request and
response shapes."""
