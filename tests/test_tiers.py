"""The test tiers (tests/conftest.py): a fast test cannot start a process, and the integration list
names only modules that exist."""
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import INTEGRATION


def test_a_fast_test_that_starts_a_process_fails_naming_it(request):
    assert request.node.get_closest_marker("fast") is not None
    with pytest.raises(RuntimeError, match="fast-tier test started .*python"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_every_integration_module_exists():
    here = pathlib.Path(__file__).parent
    assert sorted(m for m in INTEGRATION if not (here / f"{m}.py").exists()) == []
