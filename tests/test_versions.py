"""The versions DigenRL declares: requirements.txt's ranges admit the oldest stack it is checked on
(a GPU machine's torch 2.11 and transformers 5.17: python3 -m lab.check_stack) and every
version requirements.lock pins for CI; the lock pins every package (a torch-private name missing
from a torch is tests/test_torch_private.py's)."""
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _lines(name: str) -> list[str]:
    return [line.split("#")[0].strip() for line in (ROOT / name).read_text().splitlines()
            if line.split("#")[0].strip()]


def test_the_lock_pins_every_package_once_and_ci_installs_it():
    pins = [Requirement(line) for line in _lines("requirements.lock")]
    assert all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in pins), pins
    names = [canonicalize_name(r.name) for r in pins]
    assert len(names) == len(set(names))
    assert {"torch", "diffusers", "transformers", "peft", "pytest-timeout"} <= set(names)
    assert str(next(r for r in pins if r.name == "torch").specifier) == "==2.13.0"  # the CPU build CI installs
    assert "pip install -q -r requirements.lock" in (ROOT / ".ci" / "run").read_text()


def _ranges(python: str | None = None) -> dict:
    """requirements.txt's ranges that apply under `python` ("3.10"; None: this interpreter)."""
    env = None if python is None else {"python_version": python, "python_full_version": python + ".0"}
    return {canonicalize_name(r.name): r.specifier for r in map(Requirement, _lines("requirements.txt"))
            if r.marker is None or r.marker.evaluate(env)}


def test_the_ranges_admit_the_gpu_machines_stack_and_the_locked_versions():
    ranges = _ranges("3.11")  # the Python CI runs
    assert "pytest-timeout" in ranges
    for name, version in (("torch", "2.11.0"), ("transformers", "5.17.0"), ("diffusers", "0.42.1")):
        assert ranges[name].contains(Version(version)), (name, version, ranges[name])
    assert not ranges["torch"].contains(Version("2.10.0"))
    locked = {canonicalize_name(r.name): next(iter(r.specifier)).version for r in map(Requirement,
                                                                                     _lines("requirements.lock"))}
    for name, spec in ranges.items():
        assert spec.contains(Version(locked[name])), (name, locked[name], spec)


def test_python_3_10_gets_the_last_diffusers_for_it_and_tomli_and_wandb_stays_optional():
    """diffusers 0.42 needs Python 3.11: 3.10 installs 0.41 (docs/versions.md, its test run) and tomli
    for tomllib; wandb is no requirement (--wandb is optional) but the lock pins it for CI's test."""
    old, new = _ranges("3.10"), _ranges("3.11")
    assert old["diffusers"].contains(Version("0.41.0")) and not old["diffusers"].contains(Version("0.42.1"))
    assert "tomli" in old and "tomli" not in new
    assert "wandb" not in old and "wandb" not in new
    locked = {canonicalize_name(Requirement(line).name) for line in _lines("requirements.lock")}
    assert "wandb" in locked


def test_the_versions_page_keeps_each_modes_section():
    from lab.check_stack import merge_page

    old = "# head\n\nstack v1\n\n## Python 3.10\n\n3.10 v1\n\n## Python 3.12\n\n3.12 v1\n"
    assert merge_page(old, stack="# head\n\nstack v2\n") == old.replace("stack v1", "stack v2")
    assert merge_page(old, section="## Python 3.10\n\n3.10 v2\n") == \
        "# head\n\nstack v1\n\n## Python 3.12\n\n3.12 v1\n\n## Python 3.10\n\n3.10 v2\n"
    assert merge_page("", section="## Python 3.10\n\nx\n") == "\n\n## Python 3.10\n\nx\n"
    page = (ROOT / "docs" / "versions.md").read_text()
    assert "## Python 3.10" in page and "python3 -m lab.check_stack --python" in page  # the check, committed
