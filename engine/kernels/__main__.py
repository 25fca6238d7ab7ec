"""`python -m engine.kernels`: build the CPU kernels' library into the environment, as
the install does (scripts/bootstrap.sh), so that no worker builds it at start. Exits
0 either way: without a compiler the engine keeps its XLA path."""

from __future__ import annotations

import sys
import time

from engine import kernels

t0 = time.perf_counter()
try:
    path = kernels.build_installed()
except (OSError, RuntimeError) as exc:
    print(f"CPU kernels not built ({exc}); workers use the XLA path", file=sys.stderr)
else:
    print(f"CPU kernels: {path} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
