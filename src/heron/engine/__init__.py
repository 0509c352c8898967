"""Engine arguments and their resolution, the engine core (its step loop and
process), and the front ends over it: ``LLM``, ``AsyncLLM``, input and output
processing (docs/architecture.md, "Processes")."""
