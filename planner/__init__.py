"""The calibrated cost and memory model of a step, as a run reads it: the released models' specs
(specs.py, released_specs.py), GPUs, links and efficiencies (hardware.py), one step's workload
(workload.py), each phase's seconds (phases.py) and each role's memory (memory.py, which
--memory-budget-gb checks). The planner's offline side (placements, simulator, peers, fits) is in
lab/planning/.

May import parallel/ and telemetry/; never models/, a role or runtime/ (it runs without torch models)."""
