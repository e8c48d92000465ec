"""The command line: one flag per config field (`--prompts-per-step`), --config files (recipes, a
run's config.json) read first and overridden by flags, and the scripts' shared ending (a user
error is one `error:` line and exit code 2).

With --resume DIR the run starts from the config of the checkpoint it continues (DIR's newest
valid one), then the --config files, then the flags: `--resume DIR --output-dir DIR --steps N`
continues any run (checkpointing/folder.py refuses a flag that changes what the weights mean). How
the world splits into roles (ROLE_SPLIT) is one setting: a command that gives any of its flags
takes none of the others from the checkpoint, so resuming a 1 + 1 run with --mode colocated, or on
more ranks with --generators 4 --trainers 4, needs no flag undone."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from collections.abc import Callable

from checkpointing import manifest as checkpoint_files
from config import files
from config.schema import FLAGS, NOT_CARRIED, PLACEMENT_FLAGS, SECTIONS, RunConfig

ROLE_SPLIT = ("mode", "generators", "trainers", "scorers", "gap_stages")
"""the topology fields that split the world into roles, given together or taken together"""


def run(main: Callable[[], int]) -> None:
    """A script's ending: its exit code, or for a user error (ValueError) one `error:` line on
    stderr and exit code 2, with no stack trace from inside the libraries."""
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _arg_type(f: dataclasses.Field):
    """argparse's `type` of a field: its `parse` (user errors become argparse's clear message), or
    int / float / str from the annotation."""
    parse = f.metadata.get("parse")
    if parse is not None:
        def typed(text: str):
            try:
                return parse(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        typed.__name__ = f.name
        return typed
    base = f.type.replace(" | None", "")
    return {"int": int, "float": float, "str": str}.get(base, str)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, [], False):
            return text
        return super()._get_help_string(action)


def build_parser(description: str, sections: tuple[str, ...] | None = None,
                 base: RunConfig | None = None) -> argparse.ArgumentParser:
    """One flag per field (`--prompts-per-step`); `sections` limits the parser to some sections
    (scripts that share the model and sampling flags); `base` (read from --config files) gives
    the defaults, so that flags override the files."""
    base = base or RunConfig()
    parser = argparse.ArgumentParser(description=description, formatter_class=_HelpFormatter)
    files.add_config_flag(parser)
    parser.add_argument("--seed", type=int, default=base.seed, help=dataclasses.fields(RunConfig)[0].metadata["help"])
    for section, cls in SECTIONS.items():
        if sections is not None and section not in sections:
            continue
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            default = getattr(getattr(base, section), f.name)
            common = dict(dest=f"{section}.{f.name}", help=meta["help"])
            metavar = meta.get("metavar", f.name.upper())
            if meta.get("action") == "append":
                group.add_argument(flag, action="append", default=None, metavar=metavar, **common)
            elif f.type == "bool":
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **common)
            else:
                group.add_argument(flag, type=_arg_type(f), default=default, metavar=metavar, **common)
    return parser


def config_from_args(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """The RunConfig of parsed flags (`section.field` destinations; other attributes are ignored)
    over `base` (the --config files), whose lists a repeatable flag replaces when given."""
    ns = vars(args)
    cfg = copy.deepcopy(base) if base is not None else RunConfig()
    cfg.seed = ns["seed"]
    for key, value in ns.items():
        if "." not in key:
            continue
        section, name = key.split(".")
        if value is None and isinstance(getattr(getattr(cfg, section), name), list):
            continue
        setattr(getattr(cfg, section), name, value)
    return cfg


def parse_config(argv: list[str] | None, description: str = "DigenRL") -> RunConfig:
    """Flags over --config files (read first, in order). A recipe's `[recipe.needs]` flags must be
    given by then: ValueError naming the flag and what it names, before any rank waits."""
    parser, base, recipe = config_parser(argv, description)
    cfg = config_from_args(parser.parse_args(argv), base)
    files.check_needs(recipe, lambda flag: getattr(getattr(cfg, FLAGS[flag][0]), FLAGS[flag][1]))
    if cfg.topology.placement is None and names_a_placement(sys.argv[1:] if argv is None else argv):
        cfg.topology.placement = "fixed"  # `--mode disagg` names the default, and a placement all the same
    return cfg


def names_a_placement(argv: list[str]) -> bool:
    """Whether a command line gives a placement flag (PLACEMENT_FLAGS), whatever its value: the run
    then takes that placement (--placement fixed) rather than choosing one."""
    names = {"--" + n.replace("_", "-") for n in PLACEMENT_FLAGS}
    names |= {"--no-" + n[2:] for n in names}
    return any(a.split("=", 1)[0] in names for a in argv)


def config_parser(argv: list[str] | None, description: str, sections: tuple[str, ...] | None = None):
    """(parser whose defaults are --resume's checkpoint config and the --config files of argv,
    their config or None, their [recipe])."""
    early = files.config_flag()
    early.add_argument("--resume", default=None)
    for name in ROLE_SPLIT:
        early.add_argument("--" + name.replace("_", "-"), dest=name, default=None)
    known = early.parse_known_args(argv)[0]
    split_given = any(getattr(known, name) is not None for name in ROLE_SPLIT)
    first = resume_base(known.resume, split_given) if known.resume and (sections is None or "output" in sections) \
        else None
    base, recipe = load_config_files(known.config, first) if known.config or first else (None, {})
    return build_parser(description, sections, base), base, recipe


def resume_base(folder: str, split_given: bool = False) -> tuple[str, dict] | None:
    """(what it is, its config tree) of the checkpoint --resume FOLDER continues from: its newest
    valid one, without its role split when the command gives one. None when there is none:
    validation names the problem."""
    if not os.path.isdir(folder):
        return None
    found = checkpoint_files.find_valid(os.path.join(folder, "checkpoints"))
    if found.path is None:
        return None
    tree = copy.deepcopy(found.manifest.get("config") or {})
    if split_given and isinstance(tree.get("topology"), dict):
        for name in ROLE_SPLIT:
            tree["topology"].pop(name, None)
    return f"--resume {found.path} (the checkpoint's config)", tree


def load_config_files(paths: list[str], first: tuple[str, dict] | None = None) -> tuple[RunConfig, dict]:
    """A resumed checkpoint's config (`first`), then recipes and config.json files merged in order
    (config/files.py), none setting a field that is not carried -> (config, [recipe] table)."""
    tree, recipe = files.read_config_files(paths, RunConfig.from_dict, set(FLAGS), NOT_CARRIED, first)
    return RunConfig.from_dict(tree), recipe
