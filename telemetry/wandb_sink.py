"""The Weights & Biases sink of the run's records (--wandb PROJECT): what the logging rank writes to
metrics.jsonl and TensorBoard (telemetry/metrics.py), every scalar at its step, the sample and
evaluation grids (videos as their animated GIF), and the resolved config, go to one wandb run.

wandb is optional: imported here only, when a run asks for it (config/preflight.py checks before
any rank waits that it is installed). WANDB_MODE=offline writes the run to DIR/wandb/ without an
account or a network, for `wandb sync` later. Every launch of a run (a resume too) is a wandb run of
its own, grouped by the run's id (checkpointing/runrecord.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WandbOptions:
    """Where the wandb run goes and what it is called."""

    project: str
    """--wandb"""
    entity: str | None = None
    """--wandb-entity: the team or user (None: wandb's default)"""
    name: str | None = None
    """--wandb-run-name"""
    tags: tuple[str, ...] = ()
    """--wandb-tags"""
    group: str | None = None
    """the run's id: the launches of one run (its resumes) side by side"""


class WandbSink:
    """One wandb run, written by the logging rank only."""

    def __init__(self, options: WandbOptions, output_dir: str, config: dict):
        import wandb  # optional: installed where --wandb is given (config/preflight.py)

        self._wandb = wandb
        try:
            self.run = wandb.init(project=options.project, entity=options.entity, name=options.name,
                                  tags=list(options.tags) or None, group=options.group, dir=output_dir, config=config)
        except Exception as e:  # noqa: BLE001 - wandb raises its own types (no login, no network)
            raise RuntimeError(f"--wandb {options.project}: wandb could not start a run ({type(e).__name__}: {e}); "
                               f"WANDB_MODE=offline logs without an account, `wandb login` gives one") from e

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def images(self, step: int, tag: str, png: str, gif: str | None, captions: list[str] | None) -> None:
        """A grid as written beside metrics.jsonl: the PNG, or a video grid's animated GIF."""
        caption = "\n".join(captions) if captions else None
        media = self._wandb.Video(gif, format="gif", caption=caption) if gif else \
            self._wandb.Image(png, caption=caption)
        self.run.log({tag: media}, step=step)

    def close(self) -> None:
        """Finish the run and stop wandb's service process: the run ends with os._exit
        (train_disagg.shutdown), which skips wandb's own exit hooks."""
        self.run.finish()
        self._wandb.teardown()
