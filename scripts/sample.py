"""Sample images (and trajectories) with the flow-matching SDE sampler, from a base model or a
training checkpoint. The model and sampling flags are the training run's own (config/schema.py), and
`--config runs/default/config.json` takes them from the run:

    python -m scripts.sample --model-path assets/shapes-flux --checkpoint runs/default/checkpoints/step-20 \\
        --prompt "a red circle" --sample-steps 20 --out-dir out/
    python -m scripts.sample --config runs/default/config.json --checkpoint runs/default/checkpoints/step-20 \\
        --prompt "a red circle" --out-dir out/
    python -m scripts.sample --config runs/default/config.json --checkpoint runs/default/checkpoints/step-20/ema \\
        --prompt "a red circle" --out-dir out-ema/     # the EMA weights (--ema-decay)
    python -m scripts.sample --model-path assets/shapes-flux --prompts data/shapes_mixed.jsonl --out-dir out/

A .jsonl prompt with its own `height`, `width` (and `frames`) is sampled at that shape, as training
samples it (prompts/resolutions.py): every shape is checked against the model before any work, batches
hold prompts of one shape, and file NNNN.png is prompt NNNN of the file, sampled with the noise of
sample id NNNN whatever the batching.
"""
from __future__ import annotations

import os

import torch
from PIL import Image
from safetensors.torch import save_file

from rl import sampler
from checkpointing.checkpoint import load_trained_weights, verify_checkpoint
from config import cli
from config.cli import config_from_args, config_parser
from models import load_model, resolve_device, resolve_dtype, set_attention
from prompts import resolutions
from prompts.sets import PromptRecord, load_prompts
from rollout import sample_images


def save_images(images, out_dir: str, indices: list[int] | None = None) -> list[str]:
    """One PNG per sample, named by its index: 0000.png, 0001.png, ... (video: the frames side by side)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for j, img in zip(range(len(images)) if indices is None else indices, images):
        if img.dim() == 4:  # (3, F, H, W) -> frames left to right
            img = torch.cat(list(img.unbind(1)), dim=-1)
        arr = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        path = os.path.join(out_dir, f"{j:04d}.png")
        Image.fromarray(arr).save(path)
        paths.append(path)
    return paths


def save_trajectories(parts: list[tuple[tuple, list[int], sampler.Trajectory]], path: str) -> None:
    """latents [B,K+1,C,H,W], sigmas [K+1], log_probs [B,K] of one shape; with several shapes each
    tensor per shape (`latents/16x32`, ...) plus `sample_ids/16x32`, the prompts it holds."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    out = {}
    for shape, rows, traj in parts:
        suffix = "" if len(parts) == 1 else "/" + resolutions.shape_name(shape)
        out |= {f"latents{suffix}": traj.latents.float().contiguous(), f"sigmas{suffix}": traj.sigmas.float().contiguous(),
                f"log_probs{suffix}": traj.log_probs.float().contiguous()}
        if suffix:
            out[f"sample_ids{suffix}"] = torch.tensor(rows, dtype=torch.int64)
    save_file(out, path)


def parse_args(argv: list[str] | None):
    p, base, _ = config_parser(argv, __doc__.strip().splitlines()[0], sections=("model", "sampling"))
    p.add_argument("--checkpoint", default=None,
                   help="a training checkpoint folder (checkpoints/step-N, or its ema/) whose trained weights to "
                        "load")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument("--prompts", help="prompt file: .txt (one per line) or .jsonl (field 'prompt', optionally "
                                       "'height', 'width', 'frames': the prompt's own shape)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per forward pass")
    p.add_argument("--out-dir", default=None, help="write one PNG per sample: 0000.png, 0001.png, ...")
    p.add_argument("--save-trajectory", default=None,
                   help="write a safetensors file with latents [B,K+1,C,H,W], sigmas [K+1], log_probs [B,K] "
                        "(several shapes: one of each per shape, as latents/HxW, with sample_ids/HxW)")
    args = p.parse_args(argv)
    cfg = config_from_args(args, base)
    cfg.resolve_defaults()
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    m, s = cfg.model, cfg.sampling
    device = resolve_device(m.device)
    if args.checkpoint:
        verify_checkpoint(args.checkpoint)  # its bytes are those its run wrote, before any model loads
    records = load_prompts(args.prompts) if args.prompts else [PromptRecord(p) for p in args.prompt]
    adapter = load_model(m.model, m.model_path, preset=m.preset, seed=cfg.seed, device=device,
                         dtype=resolve_dtype(m.dtype, device))
    set_attention(adapter, m.attention)
    if args.checkpoint:
        load_trained_weights(adapter, args.checkpoint)
    sampling = sampler.SamplingConfig.for_adapter(
        adapter, height=s.height, width=s.width, num_steps=s.sample_steps, sde_type=s.sde_type,
        noise_level=s.noise_level, guidance=s.guidance, cfg_scale=s.cfg_scale, seed=cfg.seed,
        num_frames=s.num_frames, sde_window=s.sde_window, quantize_timestep=s.quantize_timestep)
    resolutions.check_shapes(adapter, records, sampling, args.prompts or "--prompt")  # a bad shape fails before any work
    parts = []
    for shape, rows in resolutions.rows_by_shape(records, sampling).items():
        traj, images = sample_images(adapter, [records[j].prompt for j in rows], resolutions.sampling_for(sampling, shape),
                                     batch_size=args.batch_size, negative_prompt=s.negative_prompt, sample_ids=rows)
        if args.out_dir:
            save_images(images, args.out_dir, rows)
        parts.append((shape, rows, traj))
        print(f"sampled {len(rows)} image(s) of {resolutions.shape_name(shape)} with {sampling.num_steps} "
              f"{sampling.sde_type} steps (noise level {sampling.noise_level})"
              + (f" -> {args.out_dir}" if args.out_dir else ""))
    if args.save_trajectory:
        save_trajectories(parts, args.save_trajectory)
    return 0


if __name__ == "__main__":
    cli.run(main)
