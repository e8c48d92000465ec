"""One rank of the torchrun job: building it (build.py: model, roles, mechanisms, run guard), the
step loop (loop.py, one screen), the step log (steplog.py), evaluation, the run guard (guard.py:
heartbeats, signals, timeouts, blame), the start-up probe (probe.py), each role's memory measured
on its own code (measure.py, standins.py, fakemem.py, memtrack.py) and a run's view for the memory model
(memory.py), and launching runs in a subprocess (launch.py: tests, bench, figures).

The top layer below the entry: it may import everything else; nothing but train_disagg.py imports it."""
