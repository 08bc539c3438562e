"""The XLA backend's pieces that need no torch_xla (nanopt/distributed/xla.py): xla_flash off XLA, the TPU config's
step graph, TPU detection, peak memory, the spot-VM warning. On torch_xla's CPU device: e2e/test_xla_runs.py."""
from __future__ import annotations

import socket
import sys
import types
import urllib.request
from collections import namedtuple
from unittest.mock import Mock

import pytest

from nanopt.config import configs_dir, load_config, resolve
from nanopt.distributed import xla
from nanopt.recipe.attention import choose, sdpa
from nanopt.training.plan import build_plan


def test_xla_flash_off_xla_falls_back_to_sdpa_with_the_reason(caplog):
    with caplog.at_level("WARNING", logger="nanopt"):
        assert choose("xla_flash", "cpu") == ("sdpa", sdpa)
    assert "xla_flash requested but xla_flash needs `runtime.device: xla`" in caplog.text


def test_tpu_config_keeps_the_step_graph_to_a_few_micro_steps():
    # Every micro-step is unrolled into the one compiled step graph: big micro-batches, few of them.
    cfg = resolve(load_config(configs_dir() / "tpu-v6e.yaml"), 1)
    assert build_plan(cfg.train, 1).stages[0].accum <= 4, cfg.train
    assert cfg.train.global_batch_tokens == 131072  # the batch it was tuned for, unchanged
    assert "checkpoint.mirror" in (configs_dir() / "tpu-v6e.yaml").read_text()  # how a spot VM keeps its checkpoints


@pytest.mark.parametrize("files, attached", [  # CPU twins here: the device, tpu-info and the network faked
    ([], False), (["null", "vfio/vfio"], False),  # the VFIO control node alone is not a chip
    (["accel0"], True),  # v2 to v4
    (["vfio/vfio", "vfio/0", "vfio/1"], True),  # v5e, v5p, v6e
], ids=["none", "vfio-control-only", "accel", "vfio-chips"])
def test_a_tpu_is_seen_as_accel_or_vfio_chips(tmp_path, files, attached):
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    assert xla.tpu_attached(tmp_path) is attached


def test_peak_memory_falls_back_to_tpu_infos_busiest_chip_and_keeps_the_highest_use(caplog, monkeypatch):
    spmd_refuses = Mock(side_effect=RuntimeError("Invalid device SPMD:0"))
    uses = Mock(side_effect=[5 * 2**30, 9 * 2**30, 7 * 2**30])
    peak = xla.PeakMemory([("PJRT memory info", spmd_refuses), ("tpu-info", uses)])
    with caplog.at_level("WARNING", logger="nanopt"):
        assert [peak(), peak(), peak()] == [5 * 2**30, 9 * 2**30, 9 * 2**30]  # a peak, not the current use
    assert "unavailable" not in caplog.text
    peak = xla.PeakMemory([("PJRT memory info", spmd_refuses),
                           ("tpu-info", Mock(side_effect=ImportError("No module named 'tpu_info'")))])
    with caplog.at_level("WARNING", logger="nanopt"):
        assert [peak(), peak(), peak()] == [None, None, None]
    assert caplog.text.count("peak memory unavailable on this device") == 1  # one warning, saying why
    assert "SPMD:0" in caplog.text and "tpu_info" in caplog.text
    # tpu-info's hbm is the busiest chip's use. Its API (tpu_info.device.get_local_chips,
    # tpu_info.metrics.get_chip_usage -> Usage(device_id, memory_usage, total_memory, duty_cycle_pct)) faked: no TPU,
    # no libtpu metrics server here.
    usage = namedtuple("Usage", "device_id memory_usage total_memory duty_cycle_pct")
    device = types.SimpleNamespace(get_local_chips=lambda: ("v6e", 4))
    metrics = types.SimpleNamespace(get_chip_usage=lambda chip: [usage(i, (10 + i % 2) * 2**30, 32 * 2**30, 100.0)
                                                                  for i in range(4)] if chip == "v6e" else [])
    package = types.ModuleType("tpu_info")
    package.device, package.metrics = device, metrics
    for name, module in (("tpu_info", package), ("tpu_info.device", device), ("tpu_info.metrics", metrics)):
        monkeypatch.setitem(sys.modules, name, module)
    assert xla.tpu_info_hbm_bytes() == 11 * 2**30
    device.get_local_chips = lambda: (None, 0)
    with pytest.raises(RuntimeError, match="no TPU chip"):
        xla.tpu_info_hbm_bytes()


@pytest.mark.parametrize("metadata, warned", [
    ({"provisioning-model": "SPOT", "preemptible": "FALSE"}, "a spot"),
    ({"provisioning-model": "STANDARD", "preemptible": "TRUE"}, "a preemptible"),
    ({"provisioning-model": "STANDARD", "preemptible": "FALSE"}, None),
    ({}, None),  # the metadata server did not answer: not on Google Cloud, or not in time
])
def test_a_spot_or_preemptible_tpu_vm_without_a_mirror_is_warned(metadata, warned):
    asked: list[str] = []
    fetch = lambda key: asked.append(key) or metadata.get(key)  # noqa: E731
    message = xla.preemption_warning("", fetch)
    assert message is None if warned is None else \
        message.startswith(f"this is {warned} TPU VM") and "--checkpoint.mirror=gs://" in message
    assert set(asked) <= {"provisioning-model", "preemptible"}
    assert xla.preemption_warning("gs://bucket/run", fetch) is None  # a mirror keeps the checkpoints


def test_the_metadata_server_unreachable_is_none_not_an_error(monkeypatch):
    seen = []
    for error in (urllib.error.URLError("Name or service not known"), socket.timeout("timed out"),
                  ConnectionRefusedError(111, "refused")):
        def urlopen(request, timeout, error=error):
            seen.append((request.full_url, request.get_header("Metadata-flavor"), timeout))
            raise error

        monkeypatch.setattr(urllib.request, "urlopen", urlopen)
        assert xla.gce_metadata("preemptible") is None
    assert seen[0] == (xla.METADATA_URL + "preemptible", "Google", 1.0)
    assert xla.METADATA_URL == "http://metadata.google.internal/computeMetadata/v1/instance/scheduling/"
