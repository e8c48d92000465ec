"""The replay of a run's recorded communication (telemetry/commtrace.py) under NCCL's rules:
replay.py finds deadlocks and group-creation faults, findings.py explains them (docs/communication.md)."""
