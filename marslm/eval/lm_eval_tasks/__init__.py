"""Task configs for lm-evaluation-harness (pass this folder to ``--include_path``)."""

from pathlib import Path

TASKS_DIR = Path(__file__).parent
