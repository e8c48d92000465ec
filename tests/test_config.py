"""config/schema.py: typed flags, one validation before any process group, the derived run facts, a
config.json that reads back as the same config, a --help without internal names, and the
algorithms' own flags declared in their own files."""
import ast
from pathlib import Path

import pytest

from config.schema import FLAGS, RunConfig
from config.validate import validate
from config.cli import build_parser, parse_config
from rl import algorithms

ROOT = Path(__file__).resolve().parent.parent


def _cfg(*argv: str) -> RunConfig:
    cfg = parse_config(["--preset", "tiny", *argv])
    cfg.resolve_defaults()
    return cfg


def test_string_flags_become_typed_fields():
    cfg = _cfg("--sde-window", "1:3", "--algorithm", "flow_grpo_fast", "--adam-betas", "0.8,0.95",
               "--debug-slow-rank", "1:2.5")
    assert cfg.sampling.sde_window == (1, 3)
    assert cfg.optim.adam_betas == (0.8, 0.95)
    assert cfg.output.debug_slow_rank == (1, 2.5)


@pytest.mark.parametrize("argv,message", [
    (["--adam-betas", "0.9"], "--adam-betas '0.9': expected two values as A,B"),
    (["--sde-window", "2-4"], "--sde-window '2-4': expected two values as A:B"),
    (["--debug-slow-rank", "x:2"], "--debug-slow-rank 'x:2'"),
])
def test_unparsable_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,world,message", [
    (["--sde-window", "3:2", "--algorithm", "flow_grpo_fast"], 2, "--sde-window 3:2 must satisfy 0 <= START < END"),
    (["--sde-window", "1:3"], 2, "use --algorithm flow_grpo_fast (got 'flow_grpo')"),
    (["--algorithm", "flow_grpo_fast"], 2, "--algorithm flow_grpo_fast needs --sde-window START:END"),
    (["--debug-slow-rank", "5:2"], 2, "--debug-slow-rank 5:2.0: the rank must be in [0, 2)"),
    (["--debug-slow-rank", "0:0.5"], 2, "the factor >= 1"),
    (["--train-micro-batch", "0"], 2, "--train-micro-batch must be >= 1, got 0"),
    (["--fragment-groups", "9"], 2, "--fragment-groups 9 must be between 1 and --prompts-per-step 8"),
    (["--lora-targets", "mlp"], 2, "unknown --lora-targets 'mlp'"),
    (["--sde-type", "ode"], 2, "unknown --sde-type 'ode'"),
    (["--save-every", "-1"], 2, "--save-every must be >= 0, got -1"),
    (["--tag", "--mode", "colocated"], 2, "--tag needs --mode disagg"),
    (["--generators", "3"], 2, "need at least one generator and one trainer"),
    (["--prompts", "/no/such/prompts.txt"], 2, "/no/such/prompts.txt"),
    (["--dtype", "float16"], 2, "--dtype float16: training in float16 needs a gradient scaler"),
])
def test_validate_names_the_bad_value(argv, world, message):
    with pytest.raises(ValueError) as e:
        validate(_cfg(*argv), world)
    assert message in str(e.value)


def test_facts_are_derived_once():
    facts = validate(_cfg("--tsp", "--train-micro-batch", "6", "--generators", "1", "--trainers", "3"), 4)
    assert (facts.disagg, facts.tsp, facts.tag, facts.num_trainers, facts.train_micro_batch) == (True, True, False, 3, 6)
    assert facts.log_rank == 1 and facts.train_sharding == "replicate"
    colocated = validate(_cfg("--mode", "colocated", "--colocated-sharding", "fsdp"), 2)
    assert not colocated.disagg and colocated.train_sharding == "fsdp" and colocated.train_micro_batch == 8
    plan = colocated.step_plan(_cfg(), 3)
    assert plan.step == 3 and plan.num_samples == 64 and {f.replica for f in plan.fragments} == {0, 1}


def test_config_json_reads_back_as_the_same_config(tmp_path):
    cfg = _cfg("--sde-window", "1:3", "--algorithm", "flow_grpo_fast", "--adam-betas", "0.8,0.95", "--reward", "shapes:0.5")
    cfg.save(str(tmp_path / "config.json"))
    import json

    again = RunConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert again == cfg and again.sampling.sde_window == (1, 3)
    with pytest.raises(ValueError, match=r"config section 'rl' has no field\(s\) \['stepz'\]"):
        RunConfig.from_dict({"rl": {"stepz": 3}})


def test_help_reads_cleanly(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one line per flag
    text = build_parser("DigenRL").format_help()
    assert "OUTPUT." not in text and "RL.STEPS" not in text
    assert "--sde-window START:END" in text and "--adam-betas B1,B2" in text
    assert "training steps (one rollout each, --updates-per-rollout optimizer updates) (default: 50)" in text
    assert "(default: the model's) (default" not in text and "default: None" not in text  # said once, or not at all


def test_the_old_algorithm_spelling_warns_and_is_recorded_in_the_new_one():
    with pytest.warns(UserWarning, match="--algorithm window is now spelled --algorithm flow_grpo_fast"):
        cfg = _cfg("--sde-window", "1:3", "--algorithm", "window")
    assert cfg.rl.algorithm == "flow_grpo_fast"
    assert validate(cfg, 2).tsp is False  # the window checks pass under the new name


def declared_fields(path: Path) -> dict[str, int]:
    """Field name -> line of every annotated name in the class bodies of a Python file."""
    return {node.target.id: node.lineno for cls in ast.walk(ast.parse(path.read_text()))
            if isinstance(cls, ast.ClassDef) for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def find_misplaced_flags(root: Path, owned: dict[str, list[str]], schema: str = "config/schema.py") -> list[str]:
    """Flags an algorithm owns (`owned`: its file -> its fields) that its file does not declare,
    that config/schema.py declares too, or that another algorithm owns too."""
    in_schema, owner, out = declared_fields(root / schema), {}, []
    for path, names in owned.items():
        in_file = declared_fields(root / path)
        for name in names:
            if name not in in_file:
                out.append(f"{path}: {name} is not declared there")
            if name in in_schema:
                out.append(f"{schema}:{in_schema[name]} {name}, a flag of {path}")
            if name in owner:
                out.append(f"{path}: {name}, a flag of {owner[name]} too")
            owner[name] = path
    return out


def owned_flags() -> dict[str, list[str]]:
    """Each algorithm's file -> the fields of its own flags (`Algorithm.flags`)."""
    return {type(a).__module__.replace(".", "/") + ".py": [o.split(".")[1] for o in a.own_options()]
            for a in algorithms.ALGORITHMS.values()}


def test_an_algorithms_flags_are_declared_in_its_own_file():
    owned = owned_flags()
    assert owned["rl/algorithms/flow_dppo.py"] == ["kl_mask_threshold", "add_kl_coefficient"]
    bad = find_misplaced_flags(ROOT, owned)
    assert not bad, "algorithm flags declared outside their algorithm's file:\n  " + "\n  ".join(bad)


def test_the_flag_checker_can_fail(tmp_path):
    files = {"config/schema.py": "class Rl:\n    steps: int = 1\n    foo: int = 2\n",
             "rl/algorithms/alpha.py": "class RLOptions:\n    foo: int = 0\n",
             "rl/algorithms/beta.py": "class RLOptions:\n    foo: int = 0\n    bar: int = 0\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    owned = {"rl/algorithms/alpha.py": ["foo", "baz"], "rl/algorithms/beta.py": ["foo", "bar"]}
    assert find_misplaced_flags(tmp_path, owned) == [
        "config/schema.py:3 foo, a flag of rl/algorithms/alpha.py", "rl/algorithms/alpha.py: baz is not declared there",
        "config/schema.py:3 foo, a flag of rl/algorithms/beta.py",
        "rl/algorithms/beta.py: foo, a flag of rl/algorithms/alpha.py too"]


OWN_FLAG_VALUES = {
    "sde_window_size": ("2", 2), "sde_window_range": ("0:5", (0, 5)),
    "window_size": ("3", 3), "window_stride": ("2", 2), "window_interval": ("5", 5),
    "window_schedule": ("random", "random"), "post_compress": ("0.4", 0.4), "dpm_apply": ("all", "all"),
    "drop_last_sample": (None, True), "trimmed_ratio": ("0.25", 0.25), "kl_to_old": ("0.1", 0.1),
    "advantage_rerange": ("random", "random"),
    "nft_beta": ("0.1", 0.1), "old_policy_decay": ("copy", "copy"), "old_policy_interval": ("4", 4),
    "adv_mode": ("binary", "binary"),
    "kl_mask_threshold": ("0.5", 0.5), "add_kl_coefficient": (None, False),
}
"""a value other than the default, as a flag's text (None: a bool, given as --NAME or --no-NAME) and typed"""


@pytest.mark.parametrize("owner,option", [(a.name, o) for a in algorithms.ALGORITHMS.values()
                                          for o in a.own_options()])
def test_an_algorithms_own_flag_works_for_it_and_is_refused_for_the_others(owner, option):
    section, name = option.split(".")
    text, value = OWN_FLAG_VALUES[name]
    flag = "--" + name.replace("_", "-")
    assert FLAGS[flag] == (section, name)  # its config.json key sits in the section the algorithm names
    argv = [flag if value else "--no-" + flag[2:]] if text is None else [flag, text]
    cfg = _cfg(*argv, "--algorithm", owner)
    assert getattr(getattr(cfg, section), name) == value != getattr(getattr(RunConfig(), section), name)
    other = next(a for a in algorithms.names() if option not in algorithms.algorithm(a).read_options())
    with pytest.raises(ValueError, match=f"^{flag} .* is read by --algorithm {owner} only: use --algorithm {owner}"):
        algorithms.check(_cfg(*argv, "--algorithm", other))
