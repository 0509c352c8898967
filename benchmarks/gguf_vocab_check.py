"""heron's GGUF tokenizers against llama.cpp's own expected tokens: llama.cpp ships
vocabulary-only GGUF files with test texts (``.inp``) and the token ids llama.cpp
produces for them (``.out``); this encodes every text with heron's tokenizer for
the file and counts the texts whose ids match.

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/vocab
    tar xzf /tmp/vocab/llama_cpp_python-*.tar.gz -C /tmp/vocab --wildcards '*/models/ggml-vocab-*'
    python benchmarks/gguf_vocab_check.py /tmp/vocab/llama_cpp_python-*/vendor/llama.cpp/models

Exits 1 if any text of a vocabulary heron loads tokenizes differently.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from heron.loader.tokenizer import load_gguf_tokenizer

SEPARATOR = "\n__ggml_vocab_test__\n"


def check(path: str, show: int = 3) -> tuple[int, int]:
    """(texts matching, texts) for one vocabulary file."""
    tokenizer = load_gguf_tokenizer(path)
    with open(path + ".inp", encoding="utf-8") as file:
        texts = file.read().split(SEPARATOR)
    with open(path + ".out", encoding="utf-8") as file:
        expected = [[int(token) for token in line.split()] for line in file.read().split("\n")]
    matched = 0
    for text, ids in zip(texts, expected):
        got = tokenizer.encode(text, add_special_tokens=False)
        if got == ids:
            matched += 1
        elif show > 0:
            show -= 1
            print(f"  {text[:40]!r}: llama.cpp {ids[:12]}, heron {got[:12]}")
    return matched, len(texts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models_dir", help="llama.cpp's models/ directory (ggml-vocab-*.gguf with .inp / .out)")
    args = parser.parse_args()
    failed = False
    for path in sorted(glob.glob(os.path.join(args.models_dir, "ggml-vocab-*.gguf"))):
        name = os.path.basename(path)
        if not os.path.exists(path + ".inp"):
            continue
        try:
            matched, total = check(path)
        except Exception as error:  # a vocabulary type heron does not load (WordPiece, Unigram, ...)
            print(f"{name}: not loaded ({type(error).__name__}: {str(error)[:100]})")
            continue
        failed |= matched != total
        print(f"{name}: {matched}/{total} texts tokenized as llama.cpp does")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
