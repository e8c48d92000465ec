"""The prepared GPU check: python -m scripts.gpu_check (see __main__.py and docs/gpu_check/README.md)."""
