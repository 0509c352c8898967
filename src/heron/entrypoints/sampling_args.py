"""Command-line flags for the sampling of ``heron generate`` and ``heron chat``
(the engine's own flags come from ``heron.engine.args.EngineArgs``)."""

from __future__ import annotations

import argparse


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=0.9)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="seed for this request's sampling")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
