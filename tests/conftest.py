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


#: The test files that take longest, slowest first. Under pytest-xdist (``make test``: ``-n 2 --dist loadfile
#: --no-loadscope-reorder``) files are handed to the workers in collection order: these go first, so that none of
#: them is left running alone at the end. One process (no ``-n``) keeps the plain file order.
SLOW_FIRST = ("test_megatron_vs_mindformers.py", "test_ckpt_mindformers_dir.py", "test_reliability.py",
              "test_ckpt_megatron_dir.py", "test_megatron_loop_ckpt.py", "test_locate.py", "test_state_shared.py",
              "test_distributed.py",
              "test_docs.py",
              "test_distributed_ms.py", "test_fuzz_readers.py", "test_agreement_matrix.py", "test_wikitext2.py",
              "test_megatron_launcher.py", "test_launchers.py", "test_mindformers_cpu_graph.py", "test_mindformers_trainer.py",
              "test_replay.py", "test_hf_llama.py", "test_fanout.py", "test_capture_mindspore_graph.py", "test_runs.py",
              "test_runs_drift.py")


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
