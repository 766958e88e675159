"""Optional API keys for the gateway: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
(Anthropic's clients send the latter) on ``/v1/*``.

Keys come from a file (``--api-keys-file``: one key per line, blank lines and ``#`` comments
skipped) and/or the environment (``EI_API_KEYS``: keys separated by commas or whitespace).
With no key configured the gateway is open (and says so in its start-up log and ``/health``).
A missing or wrong key is a 401 in OpenAI's shape (``code``: ``missing_api_key`` /
``invalid_api_key``) with ``WWW-Authenticate: Bearer``. ``/health`` and ``/metrics`` stay open
(probes and Prometheus scrape them; they expose counts, not content).
"""

from __future__ import annotations

import hmac
import re
from pathlib import Path

from services.drivers.gateway.api import ApiError

ENV_VAR = "EI_API_KEYS"


class ApiKeyConfigError(ValueError):
    """The key file or variable is unusable (one line, names where)."""


def parse_keys(text: str, *, comments: bool) -> list[str]:
    keys = []
    for line in text.splitlines():
        if comments:
            line = line.split("#", 1)[0]
        keys += [k for k in re.split(r"[\s,]+", line) if k]
    return keys


def load_api_keys(path: str | None = None, env_value: str | None = None) -> frozenset[str]:
    """The configured keys (empty: authentication off)."""
    keys: list[str] = []
    if path:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeyConfigError(f"--api-keys-file {path}: cannot read it ({exc})") from None
        from_file = parse_keys(text, comments=True)
        if not from_file:
            raise ApiKeyConfigError(f"--api-keys-file {path}: no key in it (one key per line)")
        keys += from_file
    if env_value:
        keys += parse_keys(env_value, comments=False)
    for k in keys:
        if len(k) < 8 or not k.isprintable():
            raise ApiKeyConfigError(f"API key {k[:3]}...: keys must be at least 8 printable characters")
    return frozenset(keys)


class ApiKeys:
    def __init__(self, keys: frozenset[str] | set[str] = frozenset()) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None, x_api_key: str | None = None) -> None:
        """Raise a 401 :class:`ApiError` unless a header carries a configured key: ``x-api-key``
        when it is present, else ``Authorization: Bearer``."""
        if not self._keys:
            return
        if x_api_key is not None:
            given = x_api_key
        else:
            if not authorization:
                raise ApiError(401, "You didn't provide an API key. Provide it in an Authorization header using "
                                    "Bearer auth (Authorization: Bearer YOUR_KEY) or in an x-api-key header.",
                               None, code="missing_api_key")
            scheme, _, given = authorization.strip().partition(" ")
            if scheme.lower() != "bearer" or not given.strip():
                raise ApiError(401, "the Authorization header must be 'Bearer YOUR_KEY'", None,
                               code="invalid_api_key")
        if not given.strip():
            raise ApiError(401, "the x-api-key header is empty", None, code="missing_api_key")
        g = given.strip().encode("utf-8", "surrogateescape")  # the bytes sent, UTF-8 or not (never a 500)
        ok = False
        for k in self._keys:  # every key is compared: the time does not say which key came close
            ok |= hmac.compare_digest(g, k)
        if not ok:
            shown = given.strip()
            hint = f"{shown[:3]}...{shown[-4:]}" if len(shown) > 10 else "***"
            raise ApiError(401, f"Incorrect API key provided: {hint}.", None, code="invalid_api_key")
