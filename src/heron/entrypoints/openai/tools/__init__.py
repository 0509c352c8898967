"""Tool calling on /v1/chat/completions: the formats models write calls in
(``parsers.py``), the prompt for templates that know no tools
(``prompting.py``), ``tool_choice`` as a grammar (``choice.py``), and calls
streamed as OpenAI's deltas (``streaming.py``)."""
