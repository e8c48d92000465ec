"""A device profile written by lab/calibrate.py, as the planner reads it (it never imports the
probe or models/: it only reads the JSON).

Two uses:
- `with_profile(gpu, profile)`: a GPU whose efficiency curve and all-gather bandwidth are the
  measured ones (MFU = counted FLOPs / measured seconds / the GPU's peak, interpolated in tokens
  per forward; clamped at the measured ends), replacing the datasheet-fitted constants;
- the shapes of per-forward cost against micro-batch that lab/planning/fit.py scales to a run: straight
  lines fitted (least squares) to the measured totals, so that a noisy point does not bend them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from planner.hardware import GPU

FORMAT = "digenrl-device-profile/1"


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares a + b x; b >= 0 and a >= 0 (a cost never shrinks with the batch)."""
    n = len(xs)
    if n == 1:
        return ys[0], 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
    a = my - b * mx
    if a < 0:
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, b


@dataclass
class DeviceProfile:
    raw: dict

    @classmethod
    def load(cls, path: str) -> "DeviceProfile":
        with open(path) as f:
            raw = json.load(f)
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "profile") -> "DeviceProfile":
        if raw.get("format") != FORMAT:
            raise ValueError(f"{where}: not a device profile (format {raw.get('format')!r}, expected {FORMAT!r})")
        for key in ("batches", "forward_s", "forward_backward_s", "flops", "outside_blocks_forward_s", "blocks",
                    "tokens_per_sample"):
            if key not in raw:
                raise ValueError(f"{where}: missing {key!r}")
        n = len(raw["batches"])
        if not n or any(len(raw[k]) != n for k in ("forward_s", "forward_backward_s", "flops",
                                                   "outside_blocks_forward_s")):
            raise ValueError(f"{where}: every measurement needs one row per batch in 'batches'")
        return cls(raw)

    @property
    def batches(self) -> list[int]:
        return list(self.raw["batches"])

    @property
    def gpu_key(self) -> str | None:
        return self.raw.get("gpu_key")

    def _totals(self, key: str) -> list[float]:
        out = []
        for row, outside in zip(self.raw[key], self.raw["outside_blocks_forward_s"]):
            out.append(sum(row) + outside * (2 if key == "forward_backward_s" else 1))
        return out

    def forward_s(self, batch: float) -> float:
        a, b = _line(self.batches, self._totals("forward_s"))
        return a + b * batch

    def train_s(self, batch: float) -> float:
        a, b = _line(self.batches, self._totals("forward_backward_s"))
        return a + b * batch

    def outside_s(self, batch: float) -> float:
        a, b = _line(self.batches, list(self.raw["outside_blocks_forward_s"]))
        return a + b * batch

    def block_forward_s(self, batch: int) -> list[float]:
        """Per-block forward seconds at the measured batch nearest to `batch` (for stage partitions)."""
        i = min(range(len(self.batches)), key=lambda j: abs(self.batches[j] - batch))
        return list(self.raw["forward_s"][i])

    # -- as a GPU's efficiency ------------------------------------------------------------------
    @property
    def finetune(self) -> str:
        """What the forward + backward timings trained: "full", or "lora:RANK:TARGETS" (frozen
        weights, gradients of the inputs and of the adapters). Profiles without the key trained fully."""
        return self.raw.get("finetune", "full")

    def mfu_points(self, peak_flops: float, phase: str) -> list[tuple[float, float]]:
        """(tokens per forward, measured MFU) per batch: forward for rollout / reference, forward +
        backward for training (3 forwards of work for full fine-tuning, 2 for LoRA: no weight
        gradients)."""
        factor = 3 if self.finetune == "full" else 2
        out = []
        for b, flops, f, fb in zip(self.batches, self.raw["flops"], self.raw["forward_s"],
                                   self.raw["forward_backward_s"]):
            secs = sum(fb) if phase == "train" else sum(f)
            work = sum(flops) * (factor if phase == "train" else 1)
            out.append((b * self.raw["tokens_per_sample"], work / secs / peak_flops))
        return sorted(out)

    def efficiency(self, g: GPU, tokens: float, phase: str) -> float:
        pts = self.mfu_points(g.peak_flops, phase)
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        return pts[-1][1]

    def busbw(self, group: int) -> float | None:
        ag = self.raw.get("allgather")
        if not ag or group > ag["group"]:
            return None
        n = ag["group"]
        rates = [b * (n - 1) / n / s for b, s in zip(ag["bytes"], ag["seconds"]) if s > 0]
        return max(rates) if rates else None


def with_profile(g: GPU, profile: DeviceProfile) -> GPU:
    """The GPU with the profile's measured efficiency and all-gather bandwidth."""
    if profile.gpu_key not in (None, g.key):
        raise ValueError(f"the profile was measured on {profile.gpu_key!r}, not {g.key!r}")
    return replace(g, measured=profile)


__all__ = ["DeviceProfile", "FORMAT", "with_profile"]

def finetune_flags(run_dir: str) -> list[str]:
    """The flags that make this probe time training as the run in `run_dir` trains (its
    config.json's LoRA rank and targets; none for full fine-tuning)."""
    with open(os.path.join(run_dir, "config.json")) as f:
        optim = json.load(f)["optim"]
    return ["--lora-rank", str(optim["lora_rank"]), "--lora-targets", optim["lora_targets"]] if optim["lora_rank"] else []
