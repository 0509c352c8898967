"""``heron bench serve | throughput | latency | compare``, with vLLM's flag names."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from heron.engine.args import EngineArgs
from heron.entrypoints.arg_types import (
    FINITE_POSITIVE_FLOAT,
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    number_at_least,
    percentiles,
    port,
    range_ratio,
    unit_interval,
)
from heron.loader.model_source import DEFAULT_MODEL_NAME


def add_bench_parsers(subcommands: Any) -> None:
    bench = subcommands.add_parser("bench", help="benchmarks: serve, throughput, latency, compare")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    serve = kinds.add_parser("serve", help="load-test OpenAI-compatible servers")
    serve.add_argument("--base-url", action="append", default=None,
                       help="server URL (repeat to compare several servers on the same prompts)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    serve.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    serve.add_argument(
        "--tokenizer", default=None,
        help="tokenizer for dataset lengths (default: --model's when it is a local model, else the embedded model's)"
    )
    serve.add_argument("--label", action="append", default=None, help="a name per --base-url for the report")
    serve.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    _add_dataset_args(serve)
    serve.add_argument("--request-rate", type=POSITIVE_FLOAT, default=float("inf"))
    serve.add_argument("--burstiness", type=FINITE_POSITIVE_FLOAT, default=1.0,
                       help="gamma shape of the gaps between sends: 1 Poisson, lower burstier, higher steadier")
    serve.add_argument("--request-timeout", type=FINITE_POSITIVE_FLOAT, default=6 * 3600.0, metavar="SECONDS",
                       help="a request without its whole answer after this long counts as failed (default 6 h, "
                            "as vLLM's client; a stalled server held the run that long)")
    serve.add_argument("--num-warmups", type=NON_NEGATIVE_INT, default=0, metavar="N",
                       help="untimed requests sent one at a time before the run (a cold server's first answers "
                            "include its warm-up: TTFT 12-33x the warm figure on a fresh heron serve)")
    serve.add_argument("--max-concurrency", type=POSITIVE_INT, default=None)
    serve.add_argument("--ignore-eos", action="store_true")
    serve.add_argument("--temperature", type=NON_NEGATIVE_FLOAT, default=0.0)
    serve.add_argument("--top-p", type=unit_interval(above_zero=True), default=None,
                       help="sent with every request when given (in (0, 1])")
    serve.add_argument("--top-k", type=number_at_least(int, -1), default=None,
                       help="sent with every request when given (-1 or 0: all tokens)")
    serve.add_argument("--min-p", type=unit_interval(), default=None, help="sent with every request when given")
    serve.add_argument("--goodput", nargs="+", default=None, metavar="SLO", help="e.g. ttft:500 tpot:50 e2el:3000 (ms)")
    serve.add_argument("--metric-percentiles", type=percentiles, default=[50.0, 90.0, 99.0])
    serve.add_argument("--save-result", action="store_true")
    serve.add_argument("--result-dir", default=None)
    serve.add_argument("--result-filename", default=None)
    serve.add_argument("--plot", action="store_true", help="write PNG charts next to the result (saves it)")
    serve.add_argument("--disable-tqdm", action="store_true")

    throughput = kinds.add_parser("throughput", help="offline throughput through LLM (all requests at once)")
    EngineArgs.add_cli_args(throughput)
    _add_dataset_args(throughput)
    throughput.add_argument("--input-len", type=POSITIVE_INT, default=None, help="alias of --random-input-len")
    throughput.add_argument("--output-len", type=POSITIVE_INT, default=None, help="alias of --random-output-len")
    throughput.add_argument("--temperature", type=float, default=1.0)
    throughput.add_argument(
        "--structured-outputs",
        type=structured_outputs,
        default=None,
        metavar="JSON",
        help='constrain every request, e.g. \'{"json": {"type": "array"}}\' or \'{"regex": "[a-z ]+"}\'',
    )
    throughput.add_argument("--output-json", default=None)
    throughput.add_argument("--disable-tqdm", action="store_true")

    latency = kinds.add_parser("latency", help="latency of one fixed batch, repeated")
    EngineArgs.add_cli_args(latency)
    latency.add_argument("--batch-size", type=POSITIVE_INT, default=8)
    latency.add_argument("--input-len", type=POSITIVE_INT, default=32)
    latency.add_argument("--output-len", type=POSITIVE_INT, default=128)
    latency.add_argument("--num-iters-warmup", type=NON_NEGATIVE_INT, default=2)
    latency.add_argument("--num-iters", type=POSITIVE_INT, default=10)
    latency.add_argument("--output-json", default=None)
    latency.add_argument("--disable-tqdm", action="store_true")

    quality = kinds.add_parser("quality", help="perplexity and agreement of a fast mode with float32")
    EngineArgs.add_cli_args(quality)
    quality.add_argument("--output-json", default=None)

    compare = kinds.add_parser("compare", help="side-by-side table of saved bench serve results")
    compare.add_argument("results", nargs="+", help="JSON files written by --save-result")
    compare.add_argument("--plot", default=None, metavar="PNG", help="also write a comparison chart")


def structured_outputs(text: str) -> dict[str, Any]:
    """``--structured-outputs``: a JSON object of StructuredOutputsParams' fields
    (checked here: a wrong one failed with a TypeError after the model loaded)."""
    from heron.sampling_params import StructuredOutputsParams

    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise TypeError("not a JSON object")
        StructuredOutputsParams(**value)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"regex\": \"[a-z ]+\"}}': "
                                         f"{exc}") from None
    return value


def _add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """Dataset flags; ``--seed`` (also the engine's, offline) seeds the prompts."""
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "prefix-repetition"])
    group.add_argument("--dataset-path", default=None)
    group.add_argument("--num-prompts", type=POSITIVE_INT, default=100)
    group.add_argument("--random-input-len", type=POSITIVE_INT, default=256)
    group.add_argument("--random-output-len", type=POSITIVE_INT, default=64)
    group.add_argument("--random-range-ratio", type=range_ratio, default=0.0)
    group.add_argument("--random-output-range-ratio", type=range_ratio, default=None,
                       help="range ratio of output lengths (default: --random-range-ratio)")
    group.add_argument("--random-prefix-len", type=NON_NEGATIVE_INT, default=0)
    group.add_argument("--sharegpt-output-len", type=POSITIVE_INT, default=None)
    group.add_argument("--prefix-repetition-prefix-len", type=NON_NEGATIVE_INT, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=POSITIVE_INT, default=64)
    group.add_argument("--prefix-repetition-num-prefixes", type=POSITIVE_INT, default=4)
    group.add_argument("--prefix-repetition-output-len", type=POSITIVE_INT, default=64)
    if not any("--seed" in action.option_strings for action in parser._actions):
        group.add_argument("--seed", type=int, default=0)


def _load_tokenizer(name: str | None) -> Any:
    """The tokenizer dataset lengths are counted in; ValueError naming ``name``
    when it cannot be loaded (a typo, a Hub id with no network)."""
    try:
        return _tokenizer_of(name)
    except OSError as exc:
        raise ValueError(f"cannot load the tokenizer {name!r} for dataset lengths: {exc}") from exc


def _tokenizer_of(name: str | None) -> Any:
    from heron.loader.model_source import resolve_model_source

    if name and not os.path.exists(name):
        if name.startswith(("/", "./", "../", "~")):  # a path, not a Hub id: transformers called it a bad repo id
            raise FileNotFoundError("no such file or directory")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    source = resolve_model_source(name)
    if source.format == "gguf":
        from heron.loader.tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(source.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path)


def _samples(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    from heron.benchmarks.datasets import prefix_repetition_dataset, random_dataset, sharegpt_dataset

    if args.dataset_path and args.dataset_name != "sharegpt":
        # it was read by nothing: the run measured random prompts under the file's name in the user's notes
        raise ValueError(f"--dataset-path is read with --dataset-name sharegpt, not {args.dataset_name}")
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        return sharegpt_dataset(tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed)
    if args.dataset_name == "prefix-repetition":
        return prefix_repetition_dataset(
            tokenizer, args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, args.seed,
        )
    input_len = args.random_input_len if getattr(args, "input_len", None) is None else args.input_len
    output_len = args.random_output_len if getattr(args, "output_len", None) is None else args.output_len
    return random_dataset(tokenizer, args.num_prompts, input_len, output_len, args.random_range_ratio,
                          args.random_prefix_len, args.seed, args.random_output_range_ratio)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        return _bench_serve(args)
    if args.bench_command == "compare":
        from heron.benchmarks.compare import comparison_table, load_results

        results = load_results(args.results)
        print(comparison_table(results))
        if args.plot:
            from heron.benchmarks.plots import plot_comparison

            print(f"wrote {plot_comparison(results, args.plot)}")
        return 0
    if args.bench_command == "quality":
        return _bench_quality(args)
    return _bench_offline(args)


def _bench_quality(args: argparse.Namespace) -> int:
    """The configured engine against the same model in float32, unquantized."""
    import json
    from dataclasses import replace

    from heron.benchmarks.quality import compare
    from heron.engine.llm import LLM

    config = EngineArgs.from_cli_args(args).create_engine_config()
    reference_config = replace(config, model=replace(config.model, quantization="none", dtype_name="float32"),
                               cache=replace(config.cache, kv_cache_dtype_name=None))
    result = compare(LLM.from_config(reference_config), LLM.from_config(config))
    result["mode"] = {"dtype": config.model.dtype_name, "quantization": config.model.quantization,
                      "kv_cache_dtype": str(config.kv_cache_dtype).removeprefix("torch.")}
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
    return 0


def _bench_offline(args: argparse.Namespace) -> int:
    from heron.benchmarks import offline
    from heron.engine.llm import LLM

    llm = LLM.from_config(EngineArgs.from_cli_args(args).create_engine_config())
    if args.bench_command == "throughput":
        samples = _samples(args, llm.get_tokenizer())
        result = offline.run_throughput(
            llm, samples, args.temperature, use_tqdm=not args.disable_tqdm, structured_outputs=args.structured_outputs
        )
        print(offline.format_throughput(result))
    else:
        result = offline.run_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters_warmup,
                                     args.num_iters, seed=args.seed, use_tqdm=not args.disable_tqdm)
        print(offline.format_latency(result))
    llm.engine.engine_core.finish_profile()
    offline.write_json(result, args.output_json)
    return 0


def _warn_about(result: dict[str, Any], ignore_eos: bool) -> None:
    """Say on stderr how many requests failed (and the first error) and, under
    ``--ignore-eos``, how many ended before their length anyway (end of sequence:
    "stop", or another server's name for it): their output lengths, and so the
    throughput, are not the ones asked (a server that ignores the field)."""
    failed = result["failed"]
    if failed:
        first_error = next((error for error in result["errors"] if error), "")
        print(f"{failed} requests failed; first error: {first_error}", file=sys.stderr)
    stopped = sum(reason not in ("", "length") for reason in result["finish_reasons"])
    if ignore_eos and stopped:
        print(f"{stopped} of {result['completed']} requests ended before their length (finish_reason \"stop\" or "
              "another) despite --ignore-eos: the server may not support ignore_eos", file=sys.stderr)


def _bench_serve(args: argparse.Namespace) -> int:
    from heron.benchmarks.compare import comparison_table
    from heron.benchmarks.metrics import parse_goodput
    from heron.benchmarks.serve import check_result_dir, format_report, run_load, summarize

    base_urls = args.base_url or [f"http://{args.host}:{args.port}"]
    labels = args.label or []
    if labels and len(labels) != len(base_urls):
        raise ValueError("give one --label per --base-url")
    goodput = parse_goodput(args.goodput)
    saving = args.save_result or args.result_filename or args.plot
    result_dir = os.path.dirname(os.path.join(args.result_dir or "", args.result_filename or "result.json"))
    if saving and result_dir:
        check_result_dir(result_dir)  # before the run, not after it (its result lost)
    # as vLLM, the model's own tokenizer by default: the embedded one measured other models' prompts wrongly
    local_model = args.model if args.model and os.path.exists(args.model) else None
    tokenizer = _load_tokenizer(args.tokenizer or local_model)
    samples = _samples(args, tokenizer)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    sampling = _sampling(args)
    results = []
    for index, base_url in enumerate(base_urls):
        model = args.model or _served_model(base_url, args.api_key)
        if not (args.tokenizer or local_model) and DEFAULT_MODEL_NAME not in model:
            print(f"note: prompt lengths are counted with the embedded {DEFAULT_MODEL_NAME} tokenizer, not "
                  f"{model!r}'s; pass --tokenizer (its directory or GGUF file) for token-exact lengths",
                  file=sys.stderr)
        client_cpu_started, started_at = time.process_time(), time.time()
        raw, duration, interrupted = asyncio.run(run_load(
            base_url, args.endpoint, model, samples,
            request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
            ignore_eos=args.ignore_eos, sampling=sampling, api_key=args.api_key,
            count_tokens=count_tokens, seed=args.seed, show_progress=not args.disable_tqdm,
            request_timeout_s=args.request_timeout, num_warmups=args.num_warmups,
        ))
        if interrupted:
            print(f"interrupted: {len(raw)} of {len(samples)} requests finished; the result is theirs",
                  file=sys.stderr)
        settings = {
            "label": labels[index] if labels else None,
            "base_url": base_url,
            "endpoint": args.endpoint,
            "model_id": model,
            "tokenizer_id": args.tokenizer or local_model or f"embedded {DEFAULT_MODEL_NAME}",
            "dataset_name": args.dataset_name,
            "num_prompts": len(samples),
            "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
            "burstiness": args.burstiness,
            "num_warmups": args.num_warmups,
            "interrupted": interrupted,
            "max_concurrency": args.max_concurrency,
            "goodput_slos_ms": goodput or None,
            "sampling": sampling,
            "ignore_eos": args.ignore_eos,
            # this process's CPU over the run (all threads): where a client saturates a core
            "client_cpu_s": time.process_time() - client_cpu_started,
            "started_at": started_at,  # epoch seconds: runs of several clients line up by it
        }
        result = summarize(raw, duration, goodput, args.metric_percentiles, settings)
        print(format_report(result, args.metric_percentiles))
        if saving:
            # one file per server (runs within a second had one name, the last kept)
            suffix = (labels[index] if labels else str(index)) if len(base_urls) > 1 else None
            _save_and_plot(args, result, raw, suffix)
        results.append(result)
        _warn_about(result, args.ignore_eos)
        if interrupted:
            return 130  # as a Ctrl-C anywhere else: the servers after this one are not measured
    if len(results) > 1:
        print(comparison_table(results))
    # nothing measured (no server, or every request failed) is not a result: a script must see it
    return 1 if any(result["completed"] == 0 for result in results) else 0


def _save_and_plot(args: argparse.Namespace, result: dict[str, Any], raw: list[Any], suffix: str | None) -> None:
    """Save one server's ``result`` (its file name with ``-suffix`` when given), and plot it if asked."""
    from heron.benchmarks.serve import default_result_filename, save_result

    filename = args.result_filename or default_result_filename(result)
    if suffix is not None:
        stem, ext = os.path.splitext(filename)
        filename = f"{stem}-{suffix}{ext}"
    path = save_result(result, args.result_dir, filename)
    print(f"saved {path}")
    if args.plot:
        from heron.benchmarks.plots import plot_run

        for chart in plot_run(raw, os.path.splitext(path)[0], result.get("label") or result["model_id"]):
            print(f"wrote {chart}")


def _sampling(args: argparse.Namespace) -> dict[str, float]:
    """The sampling fields every request of ``bench serve`` carries."""
    chosen = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    return {name: value for name, value in chosen.items() if value is not None}


def _served_model(base_url: str, api_key: str | None) -> str:
    """The server's first model, or a ValueError saying why there is none."""
    import aiohttp

    from heron.benchmarks.serve import fetch_model_name

    try:
        return asyncio.run(fetch_model_name(base_url, api_key))
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"cannot read the model name from {base_url}/v1/models ({type(exc).__name__}: {exc}); "
                         "is the server up? (or give --model)") from exc
