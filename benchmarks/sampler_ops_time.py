"""Device time of the sampler's top-k / top-p filtering and draw, per batch size,
for the filter combinations a request can ask for (a Llama-3 vocabulary).

    PYTHONPATH=src:. python3 benchmarks/sampler_ops_time.py [--batch 1 64 256] [--vocab 128256]

Each case times ``Sampler.probabilities`` and the draw on random float32 logits
(median of ``triton.testing.do_bench`` on a GPU, of a host timer on the CPU):
greedy's argmax alone for scale, then top-k 50; top-p 0.95 alone on peaked
logits (a trained model's: on the CPU the 1,024 largest hold the cut-off), on
flat ones (they do not: the candidates, then the sort, the worst case) and
through the sort alone (the GPU's way); both (through top-k's candidates, and
through the sort, which a top-k over 1,024 takes); a sort of the logits alone;
the sampling noise both ways (torch's exponential draw, the GPU's; a uniform
one and its logarithm, the CPU's); and all of it through ``Sampler`` with a
temperature. ``--check`` also compares each filtered distribution with a
float64 sort-based reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from heron.sample.ops import sample_from_probs
from heron.sample.sampler import Sampler
from heron.sample.top_k_top_p import _sorted_top_k_top_p, apply_top_k_top_p


def median_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def reference_filter(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The kept tokens of each row, by a float64 sort: the top_k largest (and ties
    with the k-th), then the shortest most-likely prefix whose mass reaches top_p."""
    values = logits.double()
    keep = torch.ones_like(values, dtype=torch.bool)
    if top_k is not None:
        kth = values.topk(top_k, dim=-1).values[:, -1:]
        keep &= values >= kth
    if top_p is not None:
        masked = values.masked_fill(~keep, float("-inf"))
        ordered, order = masked.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        cut = (probs.cumsum(dim=-1) - probs) >= top_p
        keep &= ~torch.zeros_like(keep).scatter_(1, order, cut)
    return keep


def cases(batch: int, vocab: int, device: torch.device) -> dict[str, Callable[[], object]]:
    logits = torch.randn(batch, vocab, device=device) * 3  # flat: its 1,024 largest hold under 0.95
    peaked = logits.clone()
    peaked[:, :200] += 10  # as a trained model's: 200 tokens hold 0.99 of the probability
    top_k = torch.full((batch,), 50, dtype=torch.int64, device=device)
    top_p = torch.full((batch,), 0.95, device=device)
    metadata = SimpleNamespace(temperature=torch.full((batch,), 0.8, device=device), min_p=None,
                               top_k=top_k, top_p=top_p, max_top_k=50)
    generator = torch.Generator(device=device)
    generator.manual_seed(0)

    def draw() -> torch.Tensor:
        return sample_from_probs(Sampler.probabilities(logits, metadata), {}, generator)  # type: ignore[arg-type]

    return {
        "argmax (greedy)": lambda: logits.argmax(dim=-1),
        "top-k 50": lambda: apply_top_k_top_p(logits, top_k, None, 50),
        "top-p 0.95, peaked logits": lambda: apply_top_k_top_p(peaked, None, top_p),
        "top-p 0.95, flat logits": lambda: apply_top_k_top_p(logits, None, top_p),
        "top-p 0.95, sorted path": lambda: _sorted_top_k_top_p(logits, None, top_p),
        "top-k 50 + top-p 0.95": lambda: apply_top_k_top_p(logits, top_k, top_p, 50),
        # a max_top_k past the candidates' bound takes the sorted path, as before the candidates' top-p
        "top-k 50 + top-p 0.95, sorted path": lambda: apply_top_k_top_p(logits, top_k, top_p, vocab),
        "sort alone": lambda: logits.sort(dim=-1, descending=True),
        "noise: exponential_": lambda: torch.empty_like(logits).exponential_(generator=generator),
        "noise: uniform, -log(u)": lambda: torch.empty_like(logits).uniform_(generator=generator).log_().neg_()
        .clamp_(max=1e30),
        "temperature + top-k + top-p + draw": draw,
    }


def check(vocab: int, device: torch.device) -> None:
    """The filters keep what the float64 reference keeps, on fresh random logits."""
    for trial in range(5):
        logits = torch.randn(8, vocab, device=device) * (1 + trial)
        for top_k, top_p in ((50, None), (None, 0.95), (50, 0.9), (2000, 0.5)):
            k = None if top_k is None else torch.full((8,), top_k, dtype=torch.int64, device=device)
            p = None if top_p is None else torch.full((8,), top_p, device=device)
            kept = apply_top_k_top_p(logits, k, p, top_k) > float("-inf")
            wrong = int((kept != reference_filter(logits, top_k, top_p)).sum())
            print(f"check trial {trial} top_k {top_k} top_p {top_p}: {wrong} tokens differ", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", default=None, help="also write the table as JSON")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.check:
        check(args.vocab, device)
    table: dict[str, dict[str, float]] = {}
    for batch in args.batch:
        for name, fn in cases(batch, args.vocab, device).items():
            table.setdefault(name, {})[f"batch {batch}"] = median_ms(fn, device)
    print(f"{'ms (' + str(device) + ')':36s}" + "".join(f"{b:>12s}" for b in next(iter(table.values()))))
    for name, row in table.items():
        print(f"{name:36s}" + "".join(f"{ms:12.3f}" for ms in row.values()))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
                       "vocab": args.vocab, "median_ms": table}, handle, indent=2)


if __name__ == "__main__":
    main()
