"""A user's tools, each run as `python -m scripts.NAME` from the project root: sample, eval,
encode_prompts, reward_server, plan, check_recipe, check_comm, merge_traces. A script imports the
packages (and lab/), never another script or the tests. The lab's own entry points are in lab/."""
