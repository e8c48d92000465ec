"""config/schema.py: typed flags, one validation before any process group, the derived run facts, a
config.json that reads back as the same config, and a --help without internal names."""
import pytest

from config.schema import RunConfig
from config.validate import validate
from config.cli import build_parser, parse_config


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
    assert "training steps (one optimizer update each) (default: 50)" in text
    assert "(default: the model's) (default" not in text and "default: None" not in text  # said once, or not at all


def test_the_old_algorithm_spelling_warns_and_is_recorded_in_the_new_one():
    with pytest.warns(UserWarning, match="--algorithm window is now spelled --algorithm flow_grpo_fast"):
        cfg = _cfg("--sde-window", "1:3", "--algorithm", "window")
    assert cfg.rl.algorithm == "flow_grpo_fast"
    assert validate(cfg, 2).tsp is False  # the window checks pass under the new name
