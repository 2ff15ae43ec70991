"""The benchmark harness every script in ``tools/`` uses (run them as ``python tools/bench_x.py``:
the script's folder is on ``sys.path``, so ``import bench`` finds this package).

- :mod:`bench.options`: the shared command-line options (``--ladder``, ``--quant``, ``--threads``,
  ``--json``) and the model pair they name;
- :mod:`bench.models`: the model factories (the benchmark-size and tiny generated models);
- :mod:`bench.images`: the picture, photo, animation and video factories;
- :mod:`bench.fresh`: one measurement in a fresh Python process, with its process tree's peak RSS;
- :mod:`bench.memory`: this process's memory figures and a sampler of a process tree's RSS;
- :mod:`bench.stats`: percentiles, summaries and alternating runs (A B A B) for ratios;
- :mod:`bench.record`: the JSON record (command, date, commit, machine) every run writes;
- :mod:`bench.served`: a ``gguf-mcv serve`` child and streamed requests to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

try:  # a checkout run without installing: the package beside tools/
    import gguf_mcv  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO))
