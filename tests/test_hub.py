"""nanopt.hub: an unreachable hub (no such name, refused) turns on offline mode once, a slow one does not, and the
"not reachable, not cached" errors are recognised however wrapped. No test reaches the network: the socket call is
patched. The paragraphs each command prints: test_prepare.py, e2e/test_bad_task_input.py."""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO
from huggingface_hub.errors import LocalEntryNotFoundError

from nanopt import hub


def _connect_raises(monkeypatch, error: BaseException) -> list[tuple]:
    calls: list[tuple] = []

    def create_connection(address, timeout=None):
        calls.append(address)
        raise error

    monkeypatch.setattr(socket, "create_connection", create_connection)
    return calls


@pytest.fixture
def online_env(monkeypatch):  # no offline switch, no proxy, no earlier probe answer: what a user's shell usually has
    for name in hub.OFFLINE_ENV + hub.PROXY_ENV + ("HF_ENDPOINT",):
        monkeypatch.setenv(name, "")  # recorded, so what the code under test sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(hub, "_probe", {})


NO_NAME = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
REFUSED = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
HUB = ("huggingface.co", 443)


@pytest.mark.parametrize("env, error, probed, words", [
    ({}, NO_NAME, HUB, ["huggingface.co does not resolve", "Name or service not known"]),
    ({}, REFUSED, HUB, ["huggingface.co:443 cannot be connected to", "Connection refused"]),
    ({}, OSError(errno.ENETUNREACH, "Network is unreachable"), HUB, ["Network is unreachable"]),
    ({"HF_ENDPOINT": "http://mirror.example:8080/"}, NO_NAME, ("mirror.example", 8080),
     ["mirror.example does not resolve"]),
    # A proxy is the host probed, as the hub client would reach it. Before, a proxy skipped the probe: a dead one
    # (HTTPS_PROXY=http://127.0.0.1:9) cost 51 s of retry lines.
    ({"HTTPS_PROXY": "http://proxy:3128"}, REFUSED, ("proxy", 3128), ["the proxy proxy:3128 cannot be connected to"]),
    ({"https_proxy": "proxy.local"}, REFUSED, ("proxy.local", 80), ["the proxy proxy.local:80 cannot be connected to"]),
    ({"ALL_PROXY": "socks5://127.0.0.1"}, REFUSED, ("127.0.0.1", 1080),
     ["the proxy 127.0.0.1:1080 cannot be connected to"]),
    ({"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "huggingface.co"}, REFUSED, HUB,
     ["huggingface.co:443 cannot be connected to"]),
    # A timeout may be a busy server, which a retry can reach: no offline mode for it, the libraries' retries kept.
    ({}, socket.timeout("timed out"), HUB, None),
    ({}, OSError(errno.EACCES, "Permission denied"), HUB, None),
    ({"HF_HUB_OFFLINE": "1"}, AssertionError("probed"), None, None),  # offline mode the user chose: no probe
    ({"HF_DATASETS_OFFLINE": "1"}, AssertionError("probed"), None, None),
])
def test_an_unreachable_hub_or_proxy_turns_on_offline_mode_once_and_a_slow_one_does_not(monkeypatch, online_env,
                                                                                         env, error, probed, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = _connect_raises(monkeypatch, error)
    reason = hub.offline_unless_reachable()
    assert calls == ([probed] if probed else [])
    if words is None:
        assert reason is None and os.environ.get("HF_HUB_OFFLINE") == env.get("HF_HUB_OFFLINE")
        assert probed is None or hub.unreachable() is None
        return
    assert reason is not None and all(w in reason for w in words), reason
    assert reason.startswith("the proxy ") == (any("PROXY" in k.upper() for k in env) and "NO_PROXY" not in env)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert hub.offline_unless_reachable() == reason and len(calls) == 1  # probed once per process
    assert hub.why_unreachable(OSError("anything")) == hub.unreachable() == reason  # and the probe, asked again


def test_the_libraries_errors_are_recognised_through_their_wrappers():
    # transformers: OSError("We couldn't connect to ...") raised from the hub's error
    wrapped = OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    wrapped.__cause__ = LocalEntryNotFoundError("Cannot find the requested files in the disk cache")
    assert [hub.is_unreachable_error(e) for e in (
        wrapped, ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (LocalEntryNotFoundError)"),
        OSError("meta-llama/x is not a local folder and is not a valid model"), ValueError("bad YAML"))] == [
        True, True, False, False]


def test_the_paragraph_names_what_why_and_the_fix(monkeypatch, online_env):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = hub.not_cached("`data.tokenizer` 'x/y'", OSError("offline"), "Or use a local directory.")
    assert text.startswith("`data.tokenizer` 'x/y' comes from the Hugging Face hub (https://huggingface.co)")
    assert "\n" not in text and all(words in text for words in (
        "offline mode is on: HF_HUB_OFFLINE=1", "run the same command once", "HF_DATASETS_OFFLINE=1",
        "Or use a local directory.")), text
    streamed = hub.not_cached("a stream", OSError("offline"), "Prepare elsewhere.", fetch=None)
    assert "cache here" not in streamed and streamed.endswith("Prepare elsewhere.")


@pytest.mark.slow
def test_a_dead_proxy_is_one_paragraph_at_once_naming_the_offline_fix(tmp_path):
    """A real process behind HTTPS_PROXY=http://127.0.0.1:9 (nothing listens there) with an empty hub cache. Before,
    the probe was skipped when a proxy was set: 51 s and 20 "Retrying in ..." lines, then the paragraph."""
    env = {k: v for k, v in os.environ.items() if k not in hub.OFFLINE_ENV + hub.PROXY_ENV + ("HF_ENDPOINT",)}
    env.update(HTTPS_PROXY="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "nanopt.cli", "train", "--data.tokenizer=gpt2",
                           f"--run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=60)  # the libraries' retries alone took 51 s
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "Retry" not in proc.stderr
    assert all(words in proc.stderr for words in ("`data.tokenizer` 'gpt2'", "HF_HUB_OFFLINE=1", "local directory",
                                                  "the proxy 127.0.0.1:9 cannot be connected to")), proc.stderr
