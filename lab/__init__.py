"""The lab: the offline tools a training run never imports (tests/test_architecture.py holds it).

    planning/   the planner's simulator, placements, the peer systems, published step times, the fit to
                measured runs, timelines and the bench's report (docs/planner.md, docs/calibration.md)
    memory/     each role's GPU memory measured on its own code under FakeTensorMode (docs/memory)
    nccl/       the replay of a recorded run's communication under NCCL's rules (docs/communication.md)
    launch.py   train_disagg.py (or a test script) under torchrun in a subprocess

and the lab's entry points, each run as `python -m lab.NAME` from the project root: bench,
time_to_reward, paper_table, simulate, calibrate, measure_recipes, fault_figures, make_plan_fixtures,
pretrain_tiny, train_shapes_detector, make_shapes_prompts, rl_probe. A user's tools (sample, eval,
encode_prompts, reward_server, plan, check_recipe, check_comm, merge_traces) are in scripts/.
"""
