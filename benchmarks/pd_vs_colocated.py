"""PD vs colocated experiment (see loadtest/pd_vs_colocated.py):

    python benchmarks/pd_vs_colocated.py --duration 60 --out docs/bench/pd_vs_colocated
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.pd_vs_colocated import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
