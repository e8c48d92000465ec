"""What survives a run: checkpoints in diffusers' layouts plus the run state (checkpoint.py),
complete-or-absent folders with manifests (files.py), what a resume restores (resume.py) and the
run folder itself, one run per folder (folder.py).

May import parallel/ (FSDP tensors, publication) and rl/; never a role or runtime/."""
