"""The metrics logger (nanopt/metrics.py): it refuses a metrics.jsonl that is a link, and a resume trims only the
records past its step."""
from __future__ import annotations

import pytest

from conftest import USERS, users_file
from nanopt import rundirs
from nanopt.errors import ConfigError
from nanopt.metrics import MetricsLogger


def test_the_metrics_logger_and_the_trim_refuse_a_link(tmp_path):
    mine = users_file(tmp_path)
    (tmp_path / rundirs.METRICS_FILE).symlink_to(mine)
    with pytest.raises(ConfigError, match="symbolic link"):
        MetricsLogger(tmp_path, enabled=True).trim(0)
    with pytest.raises(ConfigError, match="symbolic link"):
        MetricsLogger(tmp_path, enabled=True, tensorboard=False).open()
    assert mine.read_bytes() == USERS


def test_a_resume_trims_only_records_past_its_step_and_keeps_lines_it_cannot_read(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff damaged\n{"step": 3}\n{"step": 2}\n{"step": 5, "lo')
    MetricsLogger(tmp_path, enabled=True).trim(2)
    # The damaged middle line is the user's to look at; the cut last line would be joined by the next append.
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n\xff damaged\n{"step": 2}\n'
