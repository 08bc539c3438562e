"""nanopt.hub: an unreachable Hugging Face hub (a name that does not resolve, a refused connection) turns on the hub
libraries' offline mode once, a slow one does not, and their "not reachable, not cached" errors are recognised
however they are wrapped. No test here reaches the network: the socket call is patched. The paragraphs each command
prints: test_prepare.py, e2e/test_bad_task_input.py."""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO

from nanopt import hub


def _connect_raises(monkeypatch, error: BaseException) -> list[tuple]:
    calls: list[tuple] = []

    def create_connection(address, timeout=None):
        calls.append(address)
        raise error

    monkeypatch.setattr(socket, "create_connection", create_connection)
    return calls


@pytest.fixture
def online_env(monkeypatch):
    """No offline switch and no proxy set, and no earlier probe answer: what a user's shell usually has."""
    for name in hub.OFFLINE_ENV + hub.PROXY_ENV + ("HF_ENDPOINT",):
        monkeypatch.setenv(name, "")  # recorded, so what the code under test sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(hub, "_probe", {})


NO_NAME = socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@pytest.mark.parametrize("endpoint, error, probed, words", [
    ("", NO_NAME, ("huggingface.co", 443), ["huggingface.co does not resolve", "Name or service not known"]),
    ("", ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), ("huggingface.co", 443),
     ["huggingface.co:443", "Connection refused"]),
    ("", OSError(errno.ENETUNREACH, "Network is unreachable"), ("huggingface.co", 443), ["Network is unreachable"]),
    ("http://mirror.example:8080/", NO_NAME, ("mirror.example", 8080), ["mirror.example does not resolve"]),
])
def test_a_host_that_does_not_resolve_or_refuses_is_unreachable(monkeypatch, online_env, endpoint, error, probed,
                                                                 words):
    if endpoint:  # HF_ENDPOINT is the host probed
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
    calls = _connect_raises(monkeypatch, error)
    reason = hub.unreachable()
    assert calls == [probed]
    assert reason is not None and all(w in reason for w in words), reason


@pytest.mark.parametrize("error", [socket.timeout("timed out"), OSError(errno.EACCES, "Permission denied")])
def test_a_slow_host_keeps_the_libraries_retries(monkeypatch, online_env, error):
    """A timeout may be a busy server, which a retry can reach: no offline mode for it."""
    _connect_raises(monkeypatch, error)
    assert hub.unreachable() is None
    assert hub.offline_unless_reachable() is None
    assert "HF_HUB_OFFLINE" not in hub.os.environ


def test_an_unreachable_hub_turns_on_offline_mode_once(monkeypatch, online_env):
    calls = _connect_raises(monkeypatch, NO_NAME)
    first = hub.offline_unless_reachable()
    assert first and "does not resolve" in first
    assert hub.os.environ["HF_HUB_OFFLINE"] == "1" and hub.os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert hub.offline_unless_reachable() == first and len(calls) == 1  # probed once per process
    assert hub.why_unreachable(OSError("anything")) == first


@pytest.mark.parametrize("name, value", [("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")])
def test_offline_mode_chosen_by_the_user_is_not_probed(monkeypatch, online_env, name, value):
    monkeypatch.setenv(name, value)
    calls = _connect_raises(monkeypatch, AssertionError("probed"))
    assert hub.offline_unless_reachable() is None and calls == []


@pytest.mark.parametrize("env, probed", [
    ({"HTTPS_PROXY": "http://proxy:3128"}, ("proxy", 3128)),
    ({"https_proxy": "proxy.local"}, ("proxy.local", 80)),
    ({"ALL_PROXY": "socks5://127.0.0.1"}, ("127.0.0.1", 1080)),
    ({"HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "huggingface.co"}, ("huggingface.co", 443)),
])
def test_a_proxy_is_the_host_probed_as_the_hub_client_would_reach_it(monkeypatch, online_env, env, probed):
    """Before, a proxy skipped the probe: a dead one (HTTPS_PROXY=http://127.0.0.1:9) cost 51 s of retry lines."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = _connect_raises(monkeypatch, ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    reason = hub.offline_unless_reachable()
    assert calls == [probed] and f"{probed[0]}:{probed[1]} cannot be connected to" in reason, reason
    assert reason.startswith("the proxy ") == ("NO_PROXY" not in env)
    assert hub.os.environ["HF_HUB_OFFLINE"] == "1"


def test_the_libraries_errors_are_recognised_through_their_wrappers():
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # transformers: OSError("We couldn't connect to ...") raised from the hub's error
        try:
            raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache")
        except LocalEntryNotFoundError as inner:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files") from inner
    except OSError as e:
        wrapped = e
    assert hub.is_unreachable_error(wrapped)
    assert hub.is_unreachable_error(ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (LocalEntryNotFound"
                                                    "Error)"))
    assert not hub.is_unreachable_error(OSError("meta-llama/x is not a local folder and is not a valid model"))
    assert not hub.is_unreachable_error(ValueError("bad YAML"))


def test_the_paragraph_names_what_why_and_the_fix(monkeypatch, online_env):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = hub.not_cached("`data.tokenizer` 'x/y'", OSError("offline"), "Or use a local directory.")
    assert text.startswith("`data.tokenizer` 'x/y' comes from the Hugging Face hub (https://huggingface.co)")
    for words in ("offline mode is on: HF_HUB_OFFLINE=1", "run the same command once", "HF_DATASETS_OFFLINE=1",
                  "Or use a local directory."):
        assert words in text, text
    assert "\n" not in text
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
    for words in ("`data.tokenizer` 'gpt2'", "the proxy 127.0.0.1:9 cannot be connected to", "HF_HUB_OFFLINE=1",
                  "local directory"):
        assert words in proc.stderr, proc.stderr
