"""Finding a model's files and reading them: HF configs, safetensors and GGUF
weights, tokenizers and chat templates."""
