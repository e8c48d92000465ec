"""One rank of the torchrun job: building it (build.py: model, roles, mechanisms, run guard), the
step loop (loop.py, one screen), the step log (steplog.py), evaluation, the run guard (guard.py:
heartbeats, signals, timeouts, blame), the start-up probe (probe.py), the memory model of the
roles (memory.py) and launching runs in a subprocess (launch.py: tests, bench, figures).

The top layer below the entry: it may import everything else; nothing but train_disagg.py imports it."""
