"""The cluster planner's command line (lab/planning/plan_cli.py): which placement of a model's RL workload on
the GPUs you have is fastest, with the modelled peers beside it. `python -m scripts.plan --help`."""
from config import cli
from lab.planning.plan_cli import main

if __name__ == "__main__":
    cli.run(main)
