"""The pieces of ``bench/e2e_vs_trl.py``: runs, measurements and the report."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
