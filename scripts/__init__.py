"""Entry points, each run as `python -m scripts.NAME` from the project root. A script imports the
packages, never another script or the tests."""
