"""The planner's offline side (docs/planner.md, docs/calibration.md): every feasible placement of a
cluster (placements.py), the step simulator (simulator.py, costs.py; its event engine is
parallel/event_engine.py, which BTS runs too), the peer systems and their published step times
(peer_systems.py, published.py), the fit to measured runs (fit.py, profile.py), mixed shapes
(mixed_shapes.py), timelines (timeline.py), the bench's report (bench_report.py) and the command
line (plan_cli.py). The run itself reads only planner/ (the cost and memory model)."""
