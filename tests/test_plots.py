"""Pictures (nanopt/lab/plots.py) of run directories written by hand: `nanopt plot` names a damaged metrics line, leaves
out a value of the wrong type and refuses an output that is not a file; a picture that cannot be drawn is a
warning; an existing PNG is kept without --force. Real runs drawn: e2e/test_plots_and_watch.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FAKE_METRICS, ODD_METRICS, damage, no_traceback, read_out, write_fake_run

from nanopt import rundirs
from nanopt.cli import run as cli
from nanopt.lab import plots


@pytest.fixture
def plotted(tmp_path: Path) -> Path:
    return write_fake_run(tmp_path / "run", metrics=FAKE_METRICS)


@pytest.mark.parametrize("data, words", ODD_METRICS)
def test_plot_names_a_damaged_metrics_line(plotted, tmp_path, capsys, data, words):
    path = damage(plotted, rundirs.METRICS_FILE, data)
    assert cli(["plot", str(plotted), "--metric", "loss", "-o", str(tmp_path / "p.png")]) == 2
    _, err = read_out(capsys)
    assert err.startswith("nanopt plot: error: ") and f"{path}: {words}" in err
    no_traceback(err)
    assert not (tmp_path / "p.png").exists()


def test_plot_leaves_out_a_value_of_the_wrong_type(plotted, tmp_path, capsys):
    """A figure that is not a number is no point on the line (as a null is), not a crash."""
    odd = [{**r, "step_ms": "fast", "tokens_seen": "many"} if r["step"] == 3 else r for r in FAKE_METRICS]
    (plotted / rundirs.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in odd))
    for x in plots.X_AXES:
        out = tmp_path / f"{x}.png"
        assert cli(["plot", str(plotted), "--metric", "loss", "--x", x, "-o", str(out)]) == 0, read_out(capsys)[1]
        assert out.read_bytes()[:4] == b"\x89PNG"
    xs, _ = plots.series(plots.stepped_records(plotted), "loss", "tokens")
    assert xs == [256, 512, 768, 1024, 1280, 1536]  # step 3 from the tokens per step of the others


def test_plot_output_must_be_a_new_file_in_an_existing_directory(plotted, tmp_path, capsys, monkeypatch):
    (tmp_path / "taken.png").mkdir()
    assert cli(["plot", str(plotted), "-o", str(tmp_path / "taken.png")]) == 2
    _, err = read_out(capsys)
    assert "taken.png is a directory" in err
    no_traceback(err)
    assert cli(["plot", str(plotted), "-o", str(tmp_path / "nowhere" / "p.png")]) == 2
    assert "does not exist" in read_out(capsys)[1]
    # An existing PNG is kept unless forced. Before, a second `nanopt plot` silently replaced plot_<metric>_<x>.png
    # (every plot of a metric has that name).
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "plot_loss_steps.png"
    out.write_bytes(b"an earlier plot")
    assert cli(["plot", str(plotted), "--metric", "loss"]) == 2
    _, err = read_out(capsys)
    assert err == ("nanopt plot: error: plot_loss_steps.png already exists (an earlier plot?) and is kept; name "
                   "another file with -o, or add --force to replace it.\n")
    assert out.read_bytes() == b"an earlier plot"
    assert cli(["plot", str(plotted), "--metric", "loss", "--force"]) == 0
    assert read_out(capsys)[0] == "plot_loss_steps.png\n" and out.read_bytes()[:4] == b"\x89PNG"


def test_a_picture_that_cannot_be_drawn_is_a_warning_not_an_error(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text("")
    with caplog.at_level("WARNING", logger="nanopt"):
        assert plots.curves_quietly(tmp_path) is None
    assert "curves.png could not be drawn" in caplog.text
