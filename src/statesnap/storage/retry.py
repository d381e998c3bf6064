"""Retries for object-store requests: exponential backoff with jitter, bounded, logged.

Object stores answer a busy moment with a throttling error (S3's ``503 SlowDown``) or a passing
5xx, and a connection can drop halfway; the request is then safe to send again (every request
statesnap sends is idempotent: a PUT of the same bytes, a part of a multipart upload by number, a
ranged GET, a listing). A checkpoint is many requests, so one such answer must not fail it. Errors
that say something about the request itself (403, 404, a bad argument) are not retried: sending it
again cannot help, and a missing file must reach the caller as such.

Waits double from ``backoff_s`` up to ``max_backoff_s``; each is drawn from the upper half of that
range ("equal jitter"), so ranks throttled together do not come back together. After ``attempts``
tries the last error is raised. Every retry is logged as a warning on the ``statesnap`` logger.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass

from ..errors import described

log = logging.getLogger("statesnap")

# The jitter's own generator, seeded from the OS: drawing from the global ``random`` consumed
# the training's Python RNG (a resumed or repeated run then drew other numbers: shuffles,
# augmentations), from a background thread at no fixed point, and ranks that seed ``random``
# alike drew the same waits, so they did come back together. Seeded again in a forked child, as
# the global one is: ranks forked from one process (multiprocessing's default start on Linux)
# otherwise all drew the parent's next waits, the same sequence on every rank.
_jitter = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_jitter.seed)

# Error codes S3 (and stores speaking its API) send for "not now": throttling and server trouble,
# and two conditional writes that met (the one sent again then finds the other's object, or none).
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestLimitExceeded", "TooManyRequestsException", "ServiceUnavailable", "InternalError",
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "ConditionalRequestConflict",
})
NOT_IMPLEMENTED = 501  # a 5xx that no retry changes: the store lacks what the request asks for
# Connection failures by class name, so that no client library has to be imported to tell them:
# botocore's, aiohttp's, and the standard library's (ConnectionError covers refused and reset).
TRANSIENT_CLASSES = frozenset({
    "ConnectionError", "TimeoutError", "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError",
    "ReadTimeoutError", "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError",
    "ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError", "ClientOSError", "IncompleteRead",
})


def store_answers(exc: BaseException | None):
    """``(error, the store's error code or None, its HTTP status or 0)`` for ``exc`` and each
    error in its chain of causes: fsspec implementations translate client errors into
    ``OSError`` with the original as their cause."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code, status = None, getattr(exc, "code", None)  # gcsfs's HttpError and others carry the status
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        yield exc, code, status if isinstance(status, int) else 0
        exc = exc.__cause__ or exc.__context__


def is_transient(exc: BaseException) -> bool:
    """Would the same request, sent again later, likely succeed?"""
    for error, code, status in store_answers(exc):
        if any(cls.__name__ in TRANSIENT_CLASSES for cls in type(error).__mro__):
            return True
        if code in TRANSIENT_CODES or (status >= 500 and status != NOT_IMPLEMENTED) or status == 429:
            return True
    return False


def answered(exc: BaseException, codes: set[str], status: int) -> bool:
    """Whether the store answered the request that raised ``exc`` with one of ``codes`` or ``status``."""
    return any(code in codes or got == status for _, code, got in store_answers(exc))


def describe(exc: BaseException) -> str:
    """``exc`` with the store's error code and HTTP status where its cause has them (s3fs's
    translated errors say only, for instance, ``[Errno 16] Please reduce your request rate``)."""
    text = described(exc)
    cause = exc
    while cause is not None:
        response = getattr(cause, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
            return f"{response['Error']['Code']} (HTTP {status}): {text}"
        cause = cause.__cause__
    return text


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # tries per request, the first included
    backoff_s: float = 0.2  # the first wait's upper bound; it doubles with every retry
    max_backoff_s: float = 10.0

    def __post_init__(self):
        if self.attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"retries: need attempts >= 1 and 0 <= backoff_s <= max_backoff_s, got {self}")

    def _wait_after(self, what: str, exc: Exception, attempt: int) -> float | None:
        """Seconds to wait before trying ``what`` again after ``exc`` on try ``attempt`` (from 0),
        or None to raise it."""
        if attempt + 1 >= self.attempts or not is_transient(exc):
            return None
        cap = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
        wait = _jitter.uniform(cap / 2, cap)
        log.warning("%s: %s; retry %d of %d in %.2f s", what, describe(exc), attempt + 1, self.attempts - 1, wait)
        return wait

    def call(self, what: str, fn, *args, **kwargs):
        for attempt in range(self.attempts):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                wait = self._wait_after(what, exc, attempt)
                if wait is None:
                    raise
            time.sleep(wait)

    async def call_async(self, what: str, fn, *args, **kwargs):
        for attempt in range(self.attempts):
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                wait = self._wait_after(what, exc, attempt)
                if wait is None:
                    raise
            await asyncio.sleep(wait)
