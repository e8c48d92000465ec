"""The cluster planner: the calibrated cost model of a step (specs, hardware, workload, phases,
memory), the simulator over the step engine of parallel/, the placements it ranks against the
modelled peer systems (placements.py, systems.py, published.py), fits to measured runs (fit.py,
profile.py, costs.py) and its command line (cli.py, timeline.py, bench_report.py).

May import parallel/ and telemetry/; never models/, a role or runtime/ (it runs without torch models)."""
