import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # graphs.make_fixtures (tiny model builders) and tests.reference

GRAPHS = ROOT / "graphs"


@pytest.fixture
def fixture_path():
    """Path of a committed tiny exported model: fixture_path('llama') -> graphs/tiny-llama."""
    return lambda family: GRAPHS / f"tiny-{family.replace('_', '-')}"
