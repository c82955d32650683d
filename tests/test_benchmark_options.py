"""The benchmarks' command-line settings of the kernels' launch constants (``--sweep``, ``--set``): they reach
the constants they name, come back to the defaults after, and a misnamed one stops with the name in the
message. The benchmarks themselves need a GPU; these options do not."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

import mnemo.kernels.titans_persistent_triton as persistent
import mnemo.kernels.titans_triton_forward as forward

# The scripts import each other as siblings; their folder leaves the path after (it holds a ``models.py``).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import bench_layers
    from benchlib import launch_constant, setting, sweep_values
finally:
    sys.path.pop(0)


def test_a_setting_is_a_key_and_an_integer():
    assert setting("titans_persistent_triton.BLOCKS.warps_window=4") == ("titans_persistent_triton.BLOCKS.warps_window", 4)
    for bad in ("warps_window", "=4", "slice=four"):
        with pytest.raises(argparse.ArgumentTypeError, match="--set"):
            setting(bad)
    assert sweep_values("slice=32,64") == [("slice", 32), ("slice", 64)]
    assert sweep_values(None) == [(None, None)]


@pytest.mark.parametrize("key, value, read", [
    ("slice", 32, lambda: forward.BLOCKS["slice"]),  # a bare key: the chunk kernels' BLOCKS
    ("titans_persistent_triton.ATLAS_ON_CUDA", 1, lambda: persistent.ATLAS_ON_CUDA),
    ("titans_persistent_triton.BLOCKS.warps_window", 4, lambda: persistent.BLOCKS["warps_window"]),  # default None
])
def test_a_launch_constant_is_held_inside_and_restored_after(key, value, read):
    before = read()
    with launch_constant(key, value):
        assert read() == value and read() != before
    assert read() == before


@pytest.mark.parametrize("key", ["titans_persistent_triton.NO_SUCH", "titans_persistent_triton.BLOCKS.no_such",
                                 "titans_persistent_triton.ATLAS_ON_CUDA.key"])
def test_a_misnamed_constant_is_refused_by_name(key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        with launch_constant(key, 1):
            pass


def test_held_settings_are_restored_when_a_later_one_fails():
    args = bench_layers.parse(["--set", "titans_persistent_triton.ATLAS_ON_CUDA=1",
                               "--set", "titans_persistent_triton.BLOCKS.no_such=1"])
    with pytest.raises(ValueError, match="no_such"):
        bench_layers.loop_context(args)
    assert persistent.ATLAS_ON_CUDA is False
    args = bench_layers.parse(["--set", "titans_persistent_triton.ATLAS_ON_CUDA=1"])
    with bench_layers.loop_context(args):
        assert persistent.ATLAS_ON_CUDA is True
    assert persistent.ATLAS_ON_CUDA is False
