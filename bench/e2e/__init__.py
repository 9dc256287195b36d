"""The pieces of ``bench/e2e_vs_trl.py``: runs, measurements and the report."""
