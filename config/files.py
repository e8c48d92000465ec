"""Config files: TOML recipes (recipes/*.toml) and a run's config.json, read into the plain nested
dict that `config.RunConfig.from_dict` takes, and the provenance a run records beside its config.

A file holds the config tree's sections as tables (`[rl]`, `[optim]`, ...) and `seed` at the top.
Two more tables are not config:

- `[recipe]`: what a recipe is and needs (`RECIPE_KEYS`): a name, its published source, the GPUs it
  was sized for, and `[recipe.needs]`, the flags a user must give (a weights folder, a prompt file),
  each with what it names;
- `provenance` (written into config.json by `RunConfig.save`): the commit and package versions of
  the run that wrote the file;
- `run` (config.json and checkpoints): the run's id, the digests of its prompt files and the
  history of its resumes (checkpointing/folder.py).

Several files merge in order, a later file's value replacing an earlier one's key by key within a
section (a recipe, then a topology file); command-line flags override them all (config/schema.py).
A file never sets the fields the caller names as not carried (`drop`: where the run goes, whether
it resumes or overwrites, the test hooks): config.json describes a run, never an action.
A leaf module: it imports nothing of the project.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomllib is the standard library's copy of tomli (3.11)
    import tomli as tomllib

from prompts.sets import check_regular

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "recipe"
PROVENANCE = "provenance"
RUN = "run"
RECIPE_KEYS = {"name": str, "summary": str, "source": str, "gpu": str, "gpus": int, "model_config": str,
               "needs": dict, "notes": str}
"""What a [recipe] table may hold: name, one-line summary, the published setting it follows, the GPU
kind and count it is sized for (`runtime/budget.py` checks the fit), the released config under
models/configs/ it runs, the flags it needs, free notes."""
PACKAGES = ("torch", "diffusers", "transformers", "peft", "accelerate", "safetensors", "tokenizers",
            "huggingface_hub", "numpy", "pillow", "tensorboard")


def read_config_file(path: str) -> dict:
    """One .toml recipe or .json config as a dict; a clear ValueError naming the file otherwise."""
    if not os.path.exists(path):
        raise ValueError(f"--config {path!r}: no such file")
    check_regular(path, "--config")  # a FIFO would block every rank
    try:
        if path.endswith(".toml"):
            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif path.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
        else:
            raise ValueError("expected a .toml recipe or a .json config (a run's config.json)")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"--config {path!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r}: the file must hold a table of sections, got {type(data).__name__}")
    recipe = data.get(RECIPE, {})
    if not isinstance(recipe, dict):
        raise ValueError(f"--config {path!r}: [recipe] must be a table")
    for key, value in recipe.items():
        if key not in RECIPE_KEYS:
            raise ValueError(f"--config {path!r}: [recipe] has no key {key!r}; known: {sorted(RECIPE_KEYS)}")
        if not isinstance(value, RECIPE_KEYS[key]) or isinstance(value, bool):
            raise ValueError(f"--config {path!r}: recipe.{key} = {value!r} must be a {RECIPE_KEYS[key].__name__}")
    return data


def config_part(data: dict) -> dict:
    """The config tree of a file's dict: everything but [recipe], the provenance and the run record."""
    return {k: v for k, v in data.items() if k not in (RECIPE, PROVENANCE, RUN)}


def carried(data: dict, drop, source: str = "") -> dict:
    """A file's dict without the fields of `drop` ((section, field) pairs). A dropped action that
    the file sets (an old config.json's `overwrite = true`) is pointed out (rank 0 only)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for section, name in drop:
        table = out.get(section)
        if isinstance(table, dict) and name in table:
            value = table.pop(name)
            if source and value not in (None, False) and name != "output_dir" and os.environ.get("RANK", "0") == "0":
                print(f"note: {source}: {section}.{name} = {value!r} is not carried (a config describes a run, not "
                      f"an action): give --{name.replace('_', '-')} on the command line", file=sys.stderr)
    return out


def merge(parts: list[dict]) -> tuple[dict, dict]:
    """Merge the files' dicts in order -> (config tree, recipe table). Tables merge key by key;
    any other value (seed, a list) is replaced whole."""
    tree: dict = {}
    recipe: dict = {}
    for data in parts:
        for key, value in config_part(data).items():
            if isinstance(value, dict) and isinstance(tree.get(key), dict):
                tree[key] = {**tree[key], **value}
            else:
                tree[key] = value
        for key, value in data.get(RECIPE, {}).items():
            recipe[key] = {**recipe.get(key, {}), **value} if key == "needs" else value
    return tree, recipe


def read_config_files(paths: list[str], check, flags: set[str], drop=frozenset(),
                      first: tuple[str, dict] | None = None) -> tuple[dict, dict]:
    """Read and merge `paths` -> (config tree, [recipe] table), after `first` ((what it is, its
    tree): a resumed checkpoint's config) when given. Each file's tree is checked on its own with
    `check` (RunConfig.from_dict), so an error names the file; recipe.needs must name `flags`; no
    file sets a field of `drop`. A config.json written by other code or packages is pointed out
    (rank 0 only)."""
    parts = [carried(read_config_file(p), drop, p) for p in paths]
    start = []
    if first is not None:
        try:
            check(first[1])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{first[0]}: {e}") from None
        start = [carried(first[1], drop)]
    for path, data in zip(paths, parts):
        try:
            check(data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--config {path!r}: {e}") from None
        unknown = sorted(set(data.get(RECIPE, {}).get("needs", {})) - flags)
        if unknown:
            raise ValueError(f"--config {path!r}: recipe.needs names unknown flag(s) {unknown}")
        notes = provenance_differences(data.get(PROVENANCE) or {})
        if notes and os.environ.get("RANK", "0") == "0":
            print(f"note: {path} was written with {', '.join(notes)}: the run may not reproduce bit for bit",
                  file=sys.stderr)
    return merge(start + parts)


def check_needs(recipe: dict, value_of) -> None:
    """Every flag of [recipe.needs] has a value (`value_of(flag)` not None or empty), else a ValueError
    naming the recipe, the flag and what it names."""
    for flag, what in recipe.get("needs", {}).items():
        if value_of(flag) in (None, []):
            raise ValueError(f"recipe {recipe.get('name', '')!r} needs {flag}: {what}")


def typed(name: str, f: dataclasses.Field, value):
    """A file's value (TOML, JSON) as the config field's type (its `parse`, or int / float / str /
    bool / list of str from the annotation); a ValueError naming `section.field` otherwise."""
    base = f.type.replace(" | None", "")
    if value is None:
        if " | None" in f.type:
            return None
        raise ValueError(f"{name} = null: the field needs a {base}")
    if "parse" in f.metadata:
        return f.metadata["parse"](value)
    if base == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = {"int": int, "float": float, "str": str, "bool": bool, "list": list}[base]
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)) or \
            (expected is list and not all(isinstance(v, str) for v in value)):
        raise ValueError(f"{name} = {value!r}: expected {'a list of strings' if expected is list else base}")
    return value


CONFIG_HELP = ("a recipe (.toml, recipes/) or a run's config.json to start from, repeatable (later files override "
               "earlier ones); flags override the files")


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE", help=CONFIG_HELP)


def config_flag() -> argparse.ArgumentParser:
    """A parser of --config alone, read before the others so that the files give their defaults."""
    parser = argparse.ArgumentParser(add_help=False)
    add_config_flag(parser)
    return parser


# ----- provenance ---------------------------------------------------------------------------------
def git_commit(root: str = ROOT) -> dict:
    """{"commit": sha or None, "dirty": uncommitted changes to tracked files} of the checkout."""
    def git(*args):
        try:
            out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status)}


def package_versions() -> dict[str, str | None]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance() -> dict:
    """What config.json records besides the config: the code and packages that ran it, and how."""
    return {**git_commit(), "packages": package_versions(), "argv": sys.argv[1:]}


def provenance_differences(recorded: dict, current: dict | None = None) -> list[str]:
    """Where a config file's recorded provenance differs from this checkout (commit, package versions):
    a relaunch from it may not reproduce the run bit for bit."""
    current = current or provenance()
    notes = []
    if recorded.get("commit") and recorded.get("commit") != current.get("commit"):
        notes.append(f"commit {recorded['commit'][:12]} (now {str(current.get('commit'))[:12]})")
    if recorded.get("dirty"):
        notes.append("a checkout with uncommitted changes")
    for name, version in (recorded.get("packages") or {}).items():
        now = current["packages"].get(name)
        if version != now:
            notes.append(f"{name} {version} (now {now})")
    return notes
