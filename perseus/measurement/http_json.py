"""GET JSON from a carbon-intensity web API: cached for a time-to-live, every failure a
CarbonIntensityError that names the service and what to do (the providers add their hints)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from perseus.clock import Clock
from perseus.exceptions import CarbonIntensityError

#: A provider's advice for an HTTP error: (status, endpoint, the error) -> hint.
Hint = Callable[[int, str, urllib.error.HTTPError], str]


class CachedJSON:
    def __init__(
        self,
        service: str,
        base_url: str,
        headers: Mapping[str, str],
        timeout_s: float,
        cache_ttl_s: float,
        clock: Clock,
        hint: Hint,
    ) -> None:
        self.service = service
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.cache_ttl_s = cache_ttl_s
        self._headers = {"Accept": "application/json", "User-Agent": "perseus", **headers}
        self._clock = clock
        self._hint = hint
        self._cache: dict[str, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, endpoint: str, params: Mapping[str, str], what: str) -> Any:
        """The JSON of GET base_url/endpoint?params; `what` names the request in errors."""
        url = f"{self.base_url}/{endpoint}?{urllib.parse.urlencode(params)}"
        with self._lock:
            hit = self._cache.get(url)
            if hit is not None and self._clock.now() - hit[0] < self.cache_ttl_s:
                return hit[1]
        request = urllib.request.Request(url, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
                status = response.status
        except urllib.error.HTTPError as e:
            raise self._http_error(endpoint, e) from None
        except TimeoutError:
            raise self._timeout(endpoint) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise self._timeout(endpoint) from None
            raise CarbonIntensityError(f"cannot reach {self.service} at {self.base_url}: {e.reason}") from None
        if status == 204 or not body.strip():
            raise CarbonIntensityError(
                f"{self.service} {endpoint} has no data for {what} (HTTP {status}, an empty reply); check the "
                "location or zone, or that the service's data source covers it and the time asked"
            )
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise CarbonIntensityError(
                f"{self.service} {endpoint} for {what} returned malformed JSON: {body[:200]!r}"
            ) from None
        with self._lock:
            self._cache[url] = (self._clock.now(), data)
        return data

    def _timeout(self, endpoint: str) -> CarbonIntensityError:
        return CarbonIntensityError(
            f"{self.service} {endpoint} timed out after {self.timeout_s:g} s; retry later or raise timeout_s"
        )

    def _http_error(self, endpoint: str, error: urllib.error.HTTPError) -> CarbonIntensityError:
        try:
            detail = error.read()[:300].decode("utf-8", "replace")
        except OSError:
            detail = ""
        hint = self._hint(error.code, endpoint, error)
        return CarbonIntensityError(f"{self.service} {endpoint}: HTTP {error.code}: {hint} ({detail.strip()})")
