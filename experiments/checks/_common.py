"""The research checks share the benchmarks' helpers (``benchmarks/bench_common.py``: real or random models,
calibration windows, timing): importing ``_common`` puts ``benchmarks/`` (and through it the repository root) on
``sys.path`` and gives that module itself."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_common  # noqa: E402

sys.modules[__name__] = bench_common
