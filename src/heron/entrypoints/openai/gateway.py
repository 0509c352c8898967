"""Gateway duties in front of the engine: API keys and per-key token-bucket rate
limits (shared by every API-server process: ``shared_gateway.py``). Body and
header sizes are limited by ``http_limits.py``; admission against the engine's
queue (``--max-waiting-requests``) is checked by the handlers, which know the engine."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from heron.entrypoints.openai.errors import APIError, too_many_requests, unauthorized
from heron.entrypoints.openai.http_limits import has_body
from heron.entrypoints.openai.shared_gateway import SharedGatewayState


class APIKeyChecker:
    """Checks ``Authorization: Bearer <key>`` against the accepted keys without
    telling, by its timing, how much of a key was right or how long a right key
    is: it keeps only the SHA-256 digests of the keys, compares the presented
    key's digest (always 32 bytes) with every one of them, and goes through all
    of them whether one matched or not."""

    def __init__(self, keys: list[str]) -> None:
        self._digests = [_digest(key.encode()) for key in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> str:
        """Return the caller's key, or raise a 401 APIError."""
        return self.identify(authorization)[0]

    def identify(self, authorization: str | None) -> tuple[str, str | None]:
        """The caller's key and its digest in hex (who owns what it stores), or a
        401 APIError; ("", None) when the server takes no keys."""
        if not self._digests:
            return "", None
        if not authorization or not authorization.lower().startswith("bearer "):
            raise unauthorized()
        presented = authorization[7:].strip(" \t")  # HTTP's spaces: str.strip() took \xa0 and \x85 too
        digest = _digest(presented.encode())
        matched = False
        for stored in self._digests:  # no early exit: every key is compared
            matched |= hmac.compare_digest(digest, stored)
        if not matched:
            raise unauthorized()
        return presented, digest.hex()


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


KEY_OWNER = "heron_key_owner"  # in a request's state: the digest of the API key it came with


def key_owner(request: Request) -> str | None:
    """The digest of the API key ``request`` came with (None: the server takes no keys)."""
    return getattr(request.state, KEY_OWNER, None)


# buckets a process keeps; past it the least recently used is forgotten (full again for its key: only a key
# seen again within burst / rate seconds, after this many others, gets more than its share)
MAX_BUCKETS = 100_000


@dataclass
class _Bucket:
    tokens: float
    updated: float


class TokenBucketLimiter:
    """``rate`` requests per second per key, with bursts up to ``burst``; the
    buckets live in this process, or in the state every API-server process of
    one server shares (``shared``: ``--api-server-count``)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic,
                 shared: SharedGatewayState | None = None) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate limit needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.shared = shared
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()  # least recently used first

    def acquire(self, key: str) -> None:
        """Take one token for ``key`` or raise a 429 APIError with Retry-After."""
        now = self.clock()
        wait = self.shared.take_token(key, self.rate, self.burst, now) if self.shared else self._take(key, now)
        if wait > 0:
            raise too_many_requests(
                f"Rate limit exceeded: {self.rate:g} requests/s per key (burst {self.burst:g}).",
                wait,
                "rate_limit_exceeded",
            )

    def _take(self, key: str, now: float) -> float:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.burst, now)
            while len(self._buckets) > MAX_BUCKETS:  # the least recently seen key goes: O(1), never a scan
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens < 1.0:
            return (1.0 - bucket.tokens) / self.rate
        bucket.tokens -= 1.0
        return 0.0


# routes outside /v1 that serve the API (they read client text, cost CPU, or empty the cache):
# behind the key whenever keys are set, like /v1
KEYED_PATHS = ("/tokenize", "/detokenize", "/reset_prefix_cache")
# open even under ``protect_all``: the chat page holds nothing secret and asks for the key itself (behind the
# key, a browser could never load it, nor its key field)
OPEN_PATHS = ("/",)


class GatewayMiddleware:
    """API keys, the rate limit and readiness, as a plain ASGI middleware:
    Starlette's ``@app.middleware("http")`` would pass every streamed chunk
    through an extra task and memory stream, which costs CPU per token.

    ``/v1`` routes and ``KEYED_PATHS`` need the key and count against the rate
    limit; with ``protect_all`` (``--protect-metrics``) every other route
    (/metrics, /health, /version, the OpenAPI schema) but ``OPEN_PATHS``
    (the chat page) needs the key too.

    ``unavailable`` gives the 503 to answer while the engine cannot serve
    (loading or dead), so every /v1 route, /v1/models included, says so: a
    client or load balancer that treats any /v1 answer as readiness sends no
    request too early."""

    def __init__(
        self,
        app: ASGIApp,
        keys: APIKeyChecker,
        limiter: TokenBucketLimiter | None,
        unavailable: Callable[[], APIError | None] = lambda: None,
        protect_all: bool = False,
    ) -> None:
        self.app = app
        self.keys = keys
        self.limiter = limiter
        self.unavailable = unavailable
        self.protect_all = protect_all

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                await error.response(close=has_body(scope))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        """The error to answer instead of serving the request, if any."""
        path = scope["path"]
        versioned = path.startswith("/v1")
        api = versioned or path in KEYED_PATHS
        if not api and (not self.protect_all or path in OPEN_PATHS):
            return None
        authorization = next(
            (value.decode("latin-1") for name, value in scope.get("headers", ()) if name == b"authorization"), None
        )
        try:
            key, owner = self.keys.identify(authorization)
            if owner is not None:  # whose the stored responses are (only the key that made one reads it)
                scope.setdefault("state", {})[KEY_OWNER] = owner
            # a 503 while the engine loads spends none of the client's rate: it would arrive at
            # readiness with its bucket emptied by its own polling
            unavailable = self.unavailable() if versioned else None
            if unavailable is not None:
                return unavailable
            if api and self.limiter is not None:
                client = scope.get("client")
                self.limiter.acquire(key or (client[0] if client else "anonymous"))
        except APIError as exc:
            return exc
        return None
