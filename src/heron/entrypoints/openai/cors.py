"""Cross-origin requests (CORS) for ``heron serve``: which web pages, served
from other origins, may call the API from a browser.

Off unless ``--allowed-origins`` names some (vLLM allows every origin by
default; heron does not, since any page a user opens could otherwise use a
server on their machine). When on, Starlette's ``CORSMiddleware`` sits
outside the gateway, so a browser's preflight (an OPTIONS request that never
carries the API key) is answered without the key, and the gateway's refusals
(401, 429, 503) carry the CORS headers a page needs to read them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

ANY = "*"


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = (ANY,)
    allowed_headers: tuple[str, ...] = (ANY,)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.allow_credentials and ANY in self.allowed_origins:
            # Starlette would then echo any page's origin with credentials allowed: every site could act as the user
            raise ValueError("--allow-credentials needs --allowed-origins to name the origins, not '*'")


def name_list(text: str) -> list[str]:
    """A flag's list of names: comma separated, or a JSON list (vLLM's form,
    ``'["http://a.example"]'``)."""
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({exc.msg})") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    else:
        items = text.split(",")
    names = [item.strip() for item in items]
    if not all(names):
        raise argparse.ArgumentTypeError(f"an empty name in {text!r}")
    return names


def origin_list(text: str) -> list[str]:
    """``--allowed-origins``: '*' or origins such as ``https://app.example:8443``
    (a browser sends the origin without a path, so one given with a path, or
    without its scheme, could never match)."""
    origins = name_list(text)
    for origin in origins:
        if origin == ANY:
            continue
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query or parts.fragment:
            raise argparse.ArgumentTypeError(
                f"{origin!r} is not an origin: give scheme://host[:port], such as http://localhost:3000, or '*'"
            )
    return origins


def add_cors_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--allowed-origins", type=origin_list, action="extend", default=None, metavar="ORIGINS",
                       help="let browser pages from these origins call the API (comma separated or a JSON list, "
                            "repeatable; '*' for any); by default no cross-origin page can read an answer")
    group.add_argument("--allowed-methods", type=name_list, action="extend", default=None, metavar="METHODS",
                       help="HTTP methods cross-origin pages may use (default: any)")
    group.add_argument("--allowed-headers", type=name_list, action="extend", default=None, metavar="HEADERS",
                       help="request headers cross-origin pages may send (default: any)")
    group.add_argument("--allow-credentials", action="store_true",
                       help="let cross-origin pages send cookies and HTTP authentication (needs named origins)")


def cors_settings_from_args(args: argparse.Namespace) -> CorsSettings | None:
    """The CORS settings the flags ask for, or None when they ask for none."""
    if not args.allowed_origins:
        for flag, given in (("--allowed-methods", args.allowed_methods), ("--allowed-headers", args.allowed_headers),
                            ("--allow-credentials", args.allow_credentials)):
            if given:
                raise ValueError(f"{flag} does nothing without --allowed-origins")
        return None
    return CorsSettings(
        allowed_origins=tuple(dict.fromkeys(args.allowed_origins)),
        allowed_methods=tuple(args.allowed_methods or (ANY,)),
        allowed_headers=tuple(args.allowed_headers or (ANY,)),
        allow_credentials=args.allow_credentials,
    )


def add_cors(app: FastAPI, settings: CorsSettings) -> None:
    """Wrap the app in the CORS middleware; call it after every other
    middleware is added, so that it is the outermost."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(settings.allowed_origins),
        allow_methods=list(settings.allowed_methods),
        allow_headers=list(settings.allowed_headers),
        allow_credentials=settings.allow_credentials,
        # a page reads only the headers exposed to it: a 429's or a 503's Retry-After was hidden
        expose_headers=["Retry-After"],
    )
