"""Goodput under an SLO, PD vs colocated, over request rates (see loadtest/goodput.py):

    python benchmarks/goodput.py --out docs/bench/goodput
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.goodput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
