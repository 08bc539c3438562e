"""The metrics logger (nanopt/training/metrics.py): it refuses a metrics.jsonl that is a link, and a resume trims only the
records past its step; the console prints a library's line once; the step line names the busiest rank."""
from __future__ import annotations

import io
import logging

import pytest
from conftest import USERS, users_file

from nanopt import rundirs
from nanopt.errors import ConfigError
from nanopt.training.metrics import MetricsLogger, setup_logging, step_line


def test_the_metrics_logger_and_the_trim_refuse_a_link(tmp_path):
    mine = users_file(tmp_path)
    (tmp_path / rundirs.METRICS_FILE).symlink_to(mine)
    with pytest.raises(ConfigError, match="symbolic link"):
        MetricsLogger(tmp_path, enabled=True).trim(0)
    with pytest.raises(ConfigError, match="symbolic link"):
        MetricsLogger(tmp_path, enabled=True, tensorboard=False).open()
    assert mine.read_bytes() == USERS


@pytest.mark.parametrize("blocked", [rundirs.METRICS_FILE, rundirs.TB_DIR])
def test_a_directory_at_metrics_jsonl_or_a_file_at_tb_is_named_not_a_traceback(tmp_path, blocked):
    """Before: IsADirectoryError from the append, FileExistsError from TensorBoard's makedirs (exit 1)."""
    if blocked == rundirs.METRICS_FILE:
        (tmp_path / blocked).mkdir()
    else:
        (tmp_path / blocked).write_text("the user's notes")
    with pytest.raises(ConfigError, match=f"{tmp_path / blocked} is a "):
        MetricsLogger(tmp_path, enabled=True, tensorboard=True).open()
    assert [p.name for p in tmp_path.iterdir()] == [blocked]  # nothing written


def test_a_resume_trims_only_records_past_its_step_and_keeps_lines_it_cannot_read(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff damaged\n{"step": 3}\n{"step": 2}\n{"step": 5, "lo')
    MetricsLogger(tmp_path, enabled=True).trim(2)
    # The damaged middle line is the user's to look at; the cut last line would be joined by the next append.
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n\xff damaged\n{"step": 2}\n'


def test_a_library_line_with_its_own_handler_is_printed_once(monkeypatch, capsys):
    """huggingface_hub and datasets give their package logger a stderr handler and still pass records up to the
    console's: each hub retry line came out twice. Now the library's handler prints it, and ours everything else."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # put back after the test: setup_logging replaces them
    monkeypatch.setattr(root, "level", root.level)
    setup_logging(is_main=True)
    own = io.StringIO()
    monkeypatch.setattr(logging.getLogger("somehub"), "handlers", [logging.StreamHandler(own)])
    logging.getLogger("somehub.utils._http").warning("Retrying in 1s [Retry 1/5].")
    logging.getLogger("nanopt").warning("a nanopt warning")
    logging.getLogger("otherlib").warning("a library line without a handler of its own")
    monkeypatch.setattr(logging.getLogger("quietlib"), "handlers", [logging.NullHandler()])
    logging.getLogger("quietlib.sub").warning("a line whose library handler prints nothing")
    out = capsys.readouterr().out
    assert own.getvalue() == "Retrying in 1s [Retry 1/5].\n"
    assert "Retrying" not in out
    assert "a nanopt warning" in out and "a library line without a handler of its own" in out
    assert "a line whose library handler prints nothing" in out  # a NullHandler does not swallow it


def test_the_step_line_names_the_busiest_rank_only_across_ranks():
    values = {"loss": 2.5, "lr": 1e-3, "step_ms": 10.0, "tokens_per_s": 1000.0, "mfu": None, "eta_s": 5.0,
              "peak_memory_gib": 1.5, "peak_memory_rank": 1, "peak_reserved_gib": 2.0}
    assert "| mem 1.50 GiB @rank 1 (2.00 reserved) |" in step_line(10, 20, values, ranks=2)
    assert "| mem 1.50 GiB (2.00 reserved) |" in step_line(10, 20, values)
    assert "mem" not in step_line(10, 20, {**values, "peak_memory_gib": None}, ranks=2)
