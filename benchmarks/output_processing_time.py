"""Host time of the output processor per engine step: ``OutputProcessor.process_outputs``
fed synthetic one-token steps for a batch of requests, no model, so the figure is
the front end's own work per step (detokenization, stop strings, stats, output
objects). In the offline ``LLM`` this runs in the engine's thread after every
step; in the server, in the API-server process.

    PYTHONPATH=src:. python3 benchmarks/output_processing_time.py [--batch 256] [--steps 400] [--kind final_only]

Prints ms per step (the mean over the steps, best of --repeats), the time of the
step where every request finishes (all requests here finish together), and a
digest of the final texts, so two versions can be checked for identical output
as well as timed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.gpu.conftest import word_tokenizer  # noqa: E402

from heron.engine.input_processor import ProcessedPrompt  # noqa: E402
from heron.engine.output_processor import OutputProcessor  # noqa: E402
from heron.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from heron.step_outputs import EngineCoreOutput  # noqa: E402

VOCAB = 128256  # the size of Llama 3's vocabulary (gpu_bench's model uses this word tokenizer)


def run(tokenizer, batch: int, steps: int, kind: RequestOutputKind) -> tuple[list[float], list[str]]:
    """Milliseconds of each step's ``process_outputs``, and the final texts."""
    rng = random.Random(0)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, output_kind=kind)
    for index in range(batch):
        prompt = ProcessedPrompt(text=None, token_ids=[rng.randrange(3, VOCAB) for _ in range(128)])
        processor.add_request(f"r{index}", prompt, params)
    tokens = [[rng.randrange(3, VOCAB) for _ in range(batch)] for _ in range(steps)]
    texts: dict[str, str] = {}
    step_ms = []
    for step in range(steps):
        finish = "length" if step == steps - 1 else None
        outputs = [EngineCoreOutput(f"r{i}", [tokens[step][i]], finish_reason=finish) for i in range(batch)]
        started = time.perf_counter()
        request_outputs = processor.process_outputs(outputs).request_outputs
        step_ms.append((time.perf_counter() - started) * 1000)
        for output in request_outputs:
            text = output.outputs[0].text
            if kind == RequestOutputKind.DELTA:
                text = texts.get(output.request_id, "") + text
            texts[output.request_id] = text
    return step_ms, [texts[f"r{i}"] for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kind", choices=["final_only", "delta", "cumulative"], default="final_only")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = word_tokenizer(VOCAB)
    kind = RequestOutputKind[args.kind.upper()]
    means, finals = [], []
    for _ in range(args.repeats):
        step_ms, texts = run(tokenizer, args.batch, args.steps, kind)
        means.append(sum(step_ms) / len(step_ms))
        finals.append(step_ms[-1])
    digest = hashlib.md5("|".join(texts).encode()).hexdigest()[:12]
    print(f"{args.kind}, batch {args.batch}: {min(means):.3f} ms per step (mean over the steps, best of "
          f"{args.repeats}; all: {', '.join(f'{t:.3f}' for t in means)}); the step where all finish: "
          f"{min(finals):.2f} ms; texts md5 {digest}, {sum(map(len, texts))} chars")

if __name__ == "__main__":
    main()
