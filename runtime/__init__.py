"""One rank of the torchrun job: building it (context.py: what every role reads; build.py: roles,
mechanisms, run guard), the step loop (loop.py, one screen), one step of each role (steps.py), the
step log (steplog.py), evaluation, the run guard (guard.py: heartbeats, signals, timeouts, blame),
the start-up probe (probe.py) and a run's view of the memory model (budget.py: --memory-budget-gb).

The top layer below the entry: it may import everything else; nothing but train_disagg.py imports it."""
