"""Serve latency percentiles of heron on a GPU: TTFT, TPOT, ITL and E2E at
several concurrencies, through a live ``heron serve`` and ``heron bench serve``
(streaming completions, greedy, ignore_eos), on the random-weight
Llama-3.2-1B-shaped model of gpu_bench.py (bf16).

    PYTHONPATH=src:. python3 benchmarks/gpu_serve.py --out gpu-serve.json [--concurrency 1,8,32,128]

Prompts are random words of 256-768 tokens, outputs 128-384 tokens; each
concurrency gets enough requests to keep its slots busy for several rounds.
Writes one JSON with the device, torch and CUDA versions and, per concurrency,
the bench's full result and the CPU use of the API server, the engine core and
the bench client (``process_cpu``: mean and busiest second, % of one core).
``--model-dir`` with an existing HF directory and ``--dtype`` let the same
script run elsewhere (e.g. a tiny model on a CPU, to check the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.process_cpu import ProcessCpuSampler, child_running  # noqa: E402

CLI = [sys.executable, "-m", "heron.entrypoints.cli"]


def wait_until_ready(url: str, server: subprocess.Popen, timeout_s: float = 600.0) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return time.perf_counter() - started
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the server did not answer within {timeout_s} s")


def num_prompts_for(concurrency: int) -> int:
    return max(16, 4 * concurrency) if concurrency < 128 else 3 * concurrency


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model-dir", default="/tmp/llama-1b-random")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--server-args", default="", help="extra `heron serve` flags, e.g. '--enforce-eager'")
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]

    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "dtype": args.dtype,
                    "input_len": f"{args.input_len // 2}-{args.input_len * 3 // 2}",
                    "output_len": f"{args.output_len // 2}-{args.output_len * 3 // 2}",
                    "server_args": args.server_args}
    if torch.cuda.is_available():
        report["device"] = torch.cuda.get_device_name()
        if not os.path.exists(os.path.join(args.model_dir, "config.json")):
            from benchmarks.gpu_bench import build_model

            build_model(args.model_dir)
        report["model"] = "random-weight Llama-3.2-1B shape"
    else:
        report["device"] = "cpu"
        report["model"] = args.model_dir

    def save() -> None:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)

    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [*CLI, "serve", "--model", args.model_dir, "--dtype", args.dtype, "--port", str(args.port),
         "--max-num-seqs", str(max(256, max(levels))), *args.server_args.split()],
    )
    try:
        report["server_ready_s"] = wait_until_ready(url, server)
        save()
        with tempfile.TemporaryDirectory() as results:
            for concurrency in levels:
                name = f"conc{concurrency}.json"
                bench = subprocess.Popen(
                    [*CLI, "bench", "serve", "--base-url", url, "--tokenizer", args.model_dir,
                     "--dataset-name", "random", "--num-prompts", str(num_prompts_for(concurrency)),
                     "--random-input-len", str(args.input_len), "--random-range-ratio", "0.5",
                     "--random-output-len", str(args.output_len), "--max-concurrency", str(concurrency),
                     "--ignore-eos", "--temperature", "0", "--seed", "1", "--disable-tqdm",
                     "--save-result", "--result-dir", results, "--result-filename", name],
                )
                # the API server first: the window is where it works
                core = child_running(server.pid, "heron.engine.core_proc")
                pids = {"api_server": server.pid, **({"engine_core": core} if core else {}), "bench_client": bench.pid}
                with ProcessCpuSampler(pids) as sampler:
                    if bench.wait() != 0:
                        raise RuntimeError(f"heron bench serve exited with code {bench.returncode}")
                with open(os.path.join(results, name)) as handle:
                    report[f"concurrency_{concurrency}"] = json.load(handle)
                result = report[f"concurrency_{concurrency}"]
                result["process_cpu"] = sampler.report(duration_s=result["duration"])
                save()
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(json.dumps({key: value for key, value in report.items() if not isinstance(value, dict)}, indent=1))
    for concurrency in levels:
        cpu = report[f"concurrency_{concurrency}"]["process_cpu"]
        print(f"concurrency {concurrency}: " + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items() if "pct" in k))


if __name__ == "__main__":
    main()
