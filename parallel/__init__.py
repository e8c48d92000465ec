"""Model-agnostic distributed mechanisms and their policies: topology and process groups, P2P of
tensor dicts, the store, the step plan (stepplan.py), GAP (schedule.py, gap.py), TSP (tsp.py,
intake.py), TAG with BTS (tag.py, bts.py over the step engine engine.py), scorer ranks, FSDP2,
weight publication and its codecs.

Policies are pure functions of plain data, so the runtime, the tests and the planner's simulator
call the same code. May import rl/ and telemetry/ only: adapters, generators and trainers come in
as arguments, never as imports."""
