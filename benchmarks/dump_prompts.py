"""Write a benchmark dataset (heron's generators) to JSON, so a peer engine's own
offline API can run the very same prompts: [{"prompt", "prompt_len", "output_len"}]."""

from __future__ import annotations

import argparse
import json

from heron.benchmarks.datasets import random_dataset
from heron.loader.model_source import default_model_path
from heron.loader.tokenizer import load_gguf_tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--num-prompts", type=int, default=64)
parser.add_argument("--input-len", type=int, default=250)
parser.add_argument("--range-ratio", type=float, default=0.6)
parser.add_argument("--output-len", type=int, default=96)
parser.add_argument("--output-range-ratio", type=float, default=0.33)
parser.add_argument("--seed", type=int, default=1)
args = parser.parse_args()
samples = random_dataset(load_gguf_tokenizer(default_model_path()), args.num_prompts, args.input_len, args.output_len,
                         args.range_ratio, seed=args.seed, output_range_ratio=args.output_range_ratio)
with open(args.out, "w") as handle:
    json.dump([{"prompt": s.prompt, "prompt_len": s.prompt_len, "output_len": s.expected_output_len}
               for s in samples], handle)
