"""The models heron runs: the Llama family natively (``llama.py``), any other
causal LM through transformers (``hf_fallback.py``), all behind ``base.CausalLM``."""
