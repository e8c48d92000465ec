"""What a run records about itself: metrics (metrics.jsonl, TensorBoard, image grids), per-rank
traces, and the communication trace that scripts/check_comm.py replays under NCCL's rules (lab/nccl/).

A leaf layer: it imports nothing of the project."""
