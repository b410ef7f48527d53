import os
import sys
import warnings

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
for folder in (ROOT, TESTS):  # the package and examples; tests/helpers.py for every test folder
    if folder not in sys.path:
        sys.path.insert(0, folder)

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch):
    """No colour, and no capture settings leaking in from the environment."""
    for name in ("FORCE_COLOR", "TERM", "COLUMNS", "TENSORDIFF_OUTPUT", "TENSORDIFF_STEPS", "TENSORDIFF_TENSORS",
                 "TENSORDIFF_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
