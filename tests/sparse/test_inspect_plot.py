"""`python -m powerinfer_cpp.inspect FILE --plot OUT.png`: a sparse file's neuron statistics
drawn (frequency against rank, activations served against a VRAM budget), and clear errors
for a dense file and without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("matplotlib")

from powerinfer_cpp import format as F  # noqa: E402
from powerinfer_cpp import parse_size  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.inspect import main, plot_statistics, served_curve  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

REPO = REPO_DIR
SWIGLU_DIR = REPO / "models" / "tiny-swiglu-kjv"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inspect-plot")
    gate = convert(SWIGLU_DIR, d / "gate.gguf", "f16", progress=False, sparse=True,
                   sparse_options=SparseOptions(sparsity=0.5, calib_tokens=256, n_threads=2,
                                                vram_budget=parse_size("6M")))
    dense = convert(SWIGLU_DIR, d / "dense.gguf", "f16", progress=False)
    return Path(gate), Path(dense)


def test_plot_is_written_and_drawn(files, tmp_path, capsys):
    import matplotlib.image as mpimg

    gate, _ = files
    out = tmp_path / "stats.png"
    assert main([str(gate), "--plot", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(out)
    assert img.shape[0] > 300 and img.shape[1] > 800
    # curves, not a blank canvas: many colours, a good share of non-white pixels
    rgb = (img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 100
    assert (rgb.min(axis=1) < 200).mean() > 0.02


def test_served_curve_is_the_placement(files, tmp_path):
    import gguf

    from powerinfer_cpp.inspect import _statistics

    gate, _ = files
    res = plot_statistics(gate, tmp_path / "s.png", points=16)
    served = res["served"]
    assert served[0] == 0.0 and served[-1] == pytest.approx(1.0)
    past = res["budgets"] >= res["dense_bytes"]  # past the dense parts it only grows
    assert np.all(np.diff(served[past]) >= -1e-12)
    # at the budget the converter solved for, the greedy rule is within the ILP's share
    f = gguf.GGUFReader(str(gate)).fields
    b = int(f[F.KEY_GPU_VRAM_BUDGET].parts[-1][0])
    ilp = float(f[F.KEY_GPU_SERVED_SHARE].parts[-1][0])
    _, pin = _statistics(str(gate))
    g = float(served_curve(pin, [b])[0])
    assert 0 < g <= ilp + 1e-9 and g == pytest.approx(ilp, abs=0.02)


def test_dense_file_is_a_clear_error(files, tmp_path, capsys):
    _, dense = files
    out = tmp_path / "d.png"
    assert main([str(dense), "--plot", str(out)]) == 1
    err = capsys.readouterr().err
    assert "no neuron statistics" in err and "dense file" in err and "--sparse" in err
    assert not out.exists()


def test_without_matplotlib_says_what_to_install(files, tmp_path, monkeypatch, capsys):
    gate, _ = files
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main([str(gate), "--plot", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err
