"""The cluster planner's command line (planner/cli.py): which placement of a model's RL workload on
the GPUs you have is fastest, with the modelled peers beside it. `python -m scripts.plan --help`."""
from config import cli
from planner.cli import main

if __name__ == "__main__":
    cli.run(main)
