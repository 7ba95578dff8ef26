"""Test-wide setup.

TRITON_INTERPRET must be set before triton decorates any kernel (it decides at import time), so
it is set here, before any test module imports kernels.py. Tests that compile kernels for real
GPU targets run in a subprocess with the variable removed (see test_kernels_aot.py).
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
