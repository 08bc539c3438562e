"""The Hugging Face hub as this machine sees it: whether its first hop (the proxy httpx would use, else the hub's
host) answers at all, offline mode when it does not, and the one paragraph naming the offline fix when something
needed is not in the local cache. Torch-free. Why: the libraries retry a refused connection five times per file
(1+2+4+8+8 s, whatever the settings) before they look in their cache, 51 s per start behind a dead proxy, and a host
that does not resolve or refuses will not answer a second later as a busy one may."""
from __future__ import annotations

import errno
import logging
import os
import socket
from typing import Optional
from urllib.parse import urlsplit
from urllib.request import getproxies_environment, proxy_bypass_environment

from nanopt.errors import causes

log = logging.getLogger("nanopt")

OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
# httpx (the hub's client) goes through these, so the probe does too (NO_PROXY names the hosts it does not).
PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy")
UNREACHABLE_ERRNOS = (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN)
# What the hub libraries raise when a file is neither reachable nor cached, by class name (each library has its own;
# datasets raises the builtin ConnectionError "Couldn't reach 'NAME' on the Hub").
UNREACHABLE_ERRORS = ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectionError")
# How to fill the cache where there is network, and use it here. {fetch}: what fetches the files once.
CACHE_HINT = ("Where there is network, {fetch} once: that fills the Hugging Face cache (HF_HOME, default "
              "~/.cache/huggingface; HF_TOKEN for a gated repo); copy the cache here and set HF_HUB_OFFLINE=1 "
              "HF_DATASETS_OFFLINE=1, and nothing waits on the network.")
_probe: dict[str, Optional[str]] = {}  # the probe's answer, once per process


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def unreachable(timeout_s: float = 5.0) -> Optional[str]:
    """Why the hub's host, or the proxy in front of it, cannot be reached (no such name, refused, no route), or None:
    it answers, or it is only slow (a timeout, which the libraries' retries are for)."""
    url = urlsplit(endpoint())
    proxies = getproxies_environment()
    proxy, via = proxies.get(url.scheme) or proxies.get("all"), ""
    if proxy and not proxy_bypass_environment(url.hostname or "", proxies):
        url, via = urlsplit(proxy if "://" in proxy else f"http://{proxy}"), "the proxy "
    host, port = url.hostname or "", url.port or {"http": 80, "https": 443}.get(url.scheme, 1080)  # else SOCKS
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror as e:
        return f"{via}{host} does not resolve: {e.strerror or e}"
    except OSError as e:  # socket.timeout is an OSError without an errno: slow, not unreachable
        return (f"{via}{host}:{port} cannot be connected to: {e.strerror or e}" if e.errno in UNREACHABLE_ERRNOS
                else None)


def offline_unless_reachable() -> Optional[str]:
    """Turn on the hub libraries' offline mode when the hub cannot be reached, before they load (one INFO line);
    return why, or None. Probed once per process, and not where the user chose offline mode."""
    if "reason" not in _probe:
        _probe["reason"] = None if any(os.environ.get(k) for k in OFFLINE_ENV) else unreachable()
        if _probe["reason"]:
            os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
            log.info("the Hugging Face hub cannot be reached (%s): reading its files from the local cache only "
                     "(HF_HUB_OFFLINE=1)", _probe["reason"])
    return _probe["reason"]


def is_unreachable_error(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is the hub libraries' "not reachable and not cached"."""
    return any(type(e).__name__ in UNREACHABLE_ERRORS for e in causes(error))


def why_unreachable(error: BaseException) -> str:
    """The cause for the paragraph: the probe's answer, offline mode the user chose, or the library's own words."""
    if _probe.get("reason"):
        return _probe["reason"]  # type: ignore[return-value]
    if chosen := [k for k in OFFLINE_ENV if os.environ.get(k)]:
        return f"offline mode is on: {', '.join(f'{k}={os.environ[k]}' for k in chosen)}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")


def not_cached(what: str, error: BaseException, fix: str, fetch: Optional[str] = "run the same command") -> str:
    """The paragraph: `what` is needed from the hub, which cannot be reached (why), and is not cached; how to fill
    the cache (`fetch` does it once; None for what no cache holds, a stream), then `fix` (what to use instead)."""
    return (f"{what} comes from the Hugging Face hub ({endpoint()}), which cannot be reached from here "
            f"({why_unreachable(error)}), and it is not in the local cache. "
            + (CACHE_HINT.format(fetch=fetch) + " " if fetch else "") + fix)
