"""Would an int8 host KV tier be worth it? Its fidelity, simulated on the embedded
model: blocks saved to the host tier go through int8 and back (absmax scales in
float16, per token and head, or for keys per channel over a block's tokens as
KIVI does), and the greedy continuations of prompts whose long shared prefix is
loaded back from the tier are compared with the same engine's through the
lossless tier (its output is token-identical to recomputing; tests/model).

    python benchmarks/kv_tier_int8_fidelity.py --out DIR

Writes DIR/int8-tier-fidelity.json: per scheme, how many 32-token continuations
stay identical and where each first differs.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

import torch

import heron.worker.kv_offload_store as store_module
from heron import LLM, SamplingParams
from heron.core.kv_offload import KVTransfers


def through_int8(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` rounded to int8 with float16 absmax scales along ``dim`` and back."""
    values = x.float()
    scale = (values.abs().amax(dim=dim, keepdim=True) / 127.0).to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((values / safe).round().clamp(-127, 127) * scale).to(x.dtype)


SCHEMES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "lossless": lambda blocks: blocks.clone(),
    # blocks are [2 (K, V), n, block_size, heads, head_dim]
    "int8_per_token": lambda blocks: through_int8(blocks, -1),
    "int8_keys_per_channel": lambda blocks: torch.stack([through_int8(blocks[0], -3), through_int8(blocks[1], -1)]),
}


def run(scheme: str, seed: int) -> list[list[int]]:
    convert = SCHEMES[scheme]
    original = store_module.HostKVStore.apply

    def apply(self: store_module.HostKVStore, transfers: KVTransfers) -> None:
        if transfers.saves:
            block_ids, slots = (list(column) for column in zip(*transfers.saves, strict=True))
            for cache, store in zip(self.caches, self.store, strict=True):
                store[:, slots] = convert(cache[:, block_ids])
        original(self, KVTransfers(saves=[], loads=transfers.loads, disk=transfers.disk))

    store_module.HostKVStore.apply = apply  # type: ignore[method-assign]
    try:
        llm = LLM(num_kv_blocks=200, kv_offloading_size=1.0, max_model_len=2048)
        tokenizer = llm.get_tokenizer()
        words = sorted(w for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha())[:5000]
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            text = "".join(rng.choice(words) for _ in range(n)).replace("Ġ", " ")
            return tokenizer.encode(text, add_special_tokens=False)[:n]

        greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        outputs: list[list[int]] = []
        for _ in range(4):
            prefix = tokens(1200)
            tails = [tokens(20) for _ in range(8)]
            fillers = [tokens(1500) for _ in range(3)]  # push the prefix out of the 200-block pool
            llm.generate([{"prompt_token_ids": prefix + tails[0]}], greedy, use_tqdm=False)
            llm.generate([{"prompt_token_ids": f} for f in fillers], SamplingParams(max_tokens=1), use_tqdm=False)
            answers = llm.generate([{"prompt_token_ids": prefix + tail} for tail in tails[1:]], greedy,
                                   use_tqdm=False)
            outputs += [list(answer.outputs[0].token_ids) for answer in answers]
        offload = llm.engine.engine_core.scheduler.kv_cache_manager.offload
        assert offload is not None and offload.stats.loaded > 0, "the prefix was never loaded from the tier"
        return outputs
    finally:
        store_module.HostKVStore.apply = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    reference = run("lossless", args.seed)
    results = {}
    for scheme in ("int8_per_token", "int8_keys_per_channel"):
        outputs = run(scheme, args.seed)
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                 for x, y in zip(reference, outputs, strict=True)]
        results[scheme] = {"continuations": len(first), "identical": sum(f == len(x) for f, x in zip(first, reference,
                                                                                                      strict=True)),
                           "first_difference": sorted(first)}
        print(scheme, results[scheme])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "int8-tier-fidelity.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
