"""Pretrain the shipped shapes-world text-to-image model on CPU: a small FLUX-architecture pipeline
(FluxTransformer2DModel, CLIP + T5 text encoders with offline byte tokenizers, an AutoencoderKL),
saved as a diffusers folder that both `models.load_model("flux", model_path=...)` and
`FluxPipeline.from_pretrained(...)` load.

Two phases:
  1. autoencoder: 32x32x3 images <-> 16x16x4 latents (VAE scale factor 2), reconstruction + small KL;
     then the latent mean/std fix the VAE's shift_factor / scaling_factor, as FLUX.1's VAE config does;
  2. flow matching (rectified flow, as FLUX.1 and docs/ALGORITHMS.md): x_s = (1 - s) x0 + s eps with s
     logit-normal (SD3's choice) or uniform, the model regresses the velocity eps - x0; the
     transformer and both text encoders train jointly; an EMA of the weights is what is saved.

Captions come from data/shapes_train.txt only (template kinds balanced), so data/shapes_eval.txt
stays held out. The base model is meant to be imperfect: RL needs headroom.

The shipped model is made in two stages (its README.md records both commands and their figures):

    python -m lab.pretrain_tiny                     # 4000 steps from scratch
    python -m lab.pretrain_tiny --init-from assets/shapes-flux --fade 0.8 --steps 1000 \
        --lr 3e-4 --warmup 0 --eval-every 500          # continue in place, most images faded
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel

from rewards import shapes_world
from models import tiny_text
from models.adapter import DEFAULTS_FILE
from models.flux import encode_latents as flux_encode_latents
from models.flux import flux_scheduler

TEXT_LENGTH = 64  # T5 tokens: the longest grammar prompt is 54 bytes + </s>
FADE_WEIGHTS = (0.30, 0.45)  # colour weight of a faded image, uniform in this range: below 0.5, read as background


@dataclass
class Args:
    out: str = "assets/shapes-flux"
    """where the diffusers folder (and its README.md with the measured figures) is written"""
    seed: int = 0
    """seeds the weights, the scene stream and the noise"""
    train_prompts: str = "data/shapes_train.txt"
    """captions for training; scenes are drawn for these prompts only"""
    eval_prompts: str = "data/shapes_eval.txt"
    """held-out prompts for the progress evaluation"""
    caption_noise: float = 0.0
    """fraction of flow-matching pairs whose caption is another random train prompt (the scene stays):
    the model then draws an unrelated scene for about that fraction of samples, so the right scene is
    one of its modes rather than beyond its reach (0 = every caption matches its scene)"""
    fade: float = 0.0
    """fraction of training images whose objects are faded toward the background (`shapes_world.fade`,
    colour weight uniform in 0.30-0.45): the model then often draws faint objects, which the evaluator
    reads as background (0 = every image in full colour)"""
    init_from: str = ""
    """a folder this script wrote: skip phase 1 (its autoencoder is kept) and continue phase 2 from
    its weights (EMA restarted from them) with this run's settings; the folder's architecture is
    kept, so --width and the other architecture flags do not apply"""
    threads: int = 2
    """torch threads (1 leaves a core to others on a shared machine)"""
    vae_steps: int = 400
    """autoencoder training steps (phase 1)"""
    vae_batch_size: int = 32
    vae_lr: float = 2e-3
    kl_weight: float = 1e-4
    """weight of the KL term (per latent element) against the per-pixel MSE"""
    steps: int = 4000
    """flow-matching steps (phase 2)"""
    batch_size: int = 32
    lr: float = 1e-3
    """peak AdamW learning rate (linear warm-up, cosine decay to 10%)"""
    warmup: int = 100
    ema_decay: float = 0.998
    timestep_sampling: str = "logit_normal"
    """'logit_normal' (s = sigmoid(N(0, 1))) or 'uniform'"""
    width: int = 128
    """transformer width = heads x 32"""
    num_double_blocks: int = 2
    num_single_blocks: int = 2
    text_width: int = 64
    """T5 d_model (= the transformer's joint_attention_dim)"""
    num_text_layers: int = 2
    eval_every: int = 1000
    num_eval: int = 100
    """held-out prompts scored at each evaluation (the first N of eval_prompts)"""
    eval_steps: int = 10
    """denoising steps of FluxPipeline's ODE sampler for the evaluation"""
    log_every: int = 50
    time_limit_min: float = 0.0
    """stop phase 2 early after this many minutes of wall time (0 = no limit); the EMA is saved"""


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Args):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = Args(**vars(parser.parse_args()))
    if args.timestep_sampling not in ("logit_normal", "uniform"):
        raise ValueError(f"--timestep-sampling {args.timestep_sampling!r}: use 'logit_normal' or 'uniform'")
    if not 0 <= args.caption_noise < 1:
        raise ValueError(f"--caption-noise {args.caption_noise} must be in [0, 1)")
    if not 0 <= args.fade < 1:
        raise ValueError(f"--fade {args.fade} must be in [0, 1)")
    if args.width % 32:
        raise ValueError(f"--width {args.width} must be a multiple of the head size 32")
    return args


# ----- data -----------------------------------------------------------------------------------



class SceneStream:
    """Endless (image, caption) batches: a template kind uniformly, a train prompt of that kind,
    then a random scene for it."""

    def __init__(self, prompt_file: str, seed: int):
        with open(prompt_file) as f:
            specs = [shapes_world.parse_prompt(line) for line in f if line.strip()]
        self.by_kind = {k: [s for s in specs if s.kind == k] for k in shapes_world.KINDS}
        self.by_kind = {k: v for k, v in self.by_kind.items() if v}
        self.rng = np.random.default_rng(seed)

    def _spec(self) -> shapes_world.Spec:
        kinds = list(self.by_kind)
        pool = self.by_kind[kinds[self.rng.integers(len(kinds))]]
        return pool[self.rng.integers(len(pool))]

    def batch(self, n: int, caption_noise: float = 0.0, fade: float = 0.0) -> tuple[torch.Tensor, list[str]]:
        """With `fade` q, each image is, with probability q, faded toward the background (colour weight
        uniform in FADE_WEIGHTS). With `caption_noise` p, each caption is, with probability p, that of
        another independently drawn train prompt instead of the scene's own."""
        images, prompts = [], []
        for _ in range(n):
            spec = self._spec()
            image = shapes_world.render(shapes_world.sample_scene(self.rng, spec))
            if fade and self.rng.random() < fade:
                image = shapes_world.fade(image, self.rng.uniform(*FADE_WEIGHTS))
            images.append(image)
            if caption_noise and self.rng.random() < caption_noise:
                spec = self._spec()
            prompts.append(shapes_world.spec_to_prompt(spec))
        return shapes_world.scene_pixels(images), prompts


# ----- the pipeline -------------------------------------------------------------------------

def build_pipeline(args: Args) -> FluxPipeline:
    torch.manual_seed(args.seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=args.num_double_blocks, num_single_layers=args.num_single_blocks,
        attention_head_dim=32, num_attention_heads=args.width // 32, joint_attention_dim=args.text_width,
        pooled_projection_dim=32, axes_dims_rope=(8, 12, 12), guidance_embeds=False)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32), layers_per_block=1,
        norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        mid_block_add_attention=False, scaling_factor=1.0, shift_factor=0.0)
    tokenizer = tiny_text.clip_tokenizer(max_length=TEXT_LENGTH)
    tokenizer_2 = tiny_text.t5_tokenizer()
    tokenizer_2.model_max_length = TEXT_LENGTH  # FluxAdapter uses min(512, this) as the T5 length
    return FluxPipeline(
        scheduler=flux_scheduler(), vae=vae,
        text_encoder=tiny_text.clip_text_encoder(tokenizer, hidden=32, projection_dim=32, seed=args.seed + 1),
        tokenizer=tokenizer,
        text_encoder_2=tiny_text.t5_encoder(d_model=args.text_width, num_layers=args.num_text_layers, seed=args.seed + 2),
        tokenizer_2=tokenizer_2, transformer=transformer)


def num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def lr_factor(step: int, args: Args) -> float:
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


# ----- phase 1: the autoencoder ---------------------------------------------------------------

def train_vae(vae: AutoencoderKL, data: SceneStream, args: Args) -> float:
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    recon_avg = None
    for step in range(args.vae_steps):
        for group in opt.param_groups:
            group["lr"] = args.vae_lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * (1 - step / args.vae_steps))
        x, _ = data.batch(args.vae_batch_size)  # (B, 3, 32, 32)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        mse = F.mse_loss(recon, x)
        kl = posterior.kl().mean() / posterior.mean[0].numel()  # per latent element
        loss = mse + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        recon_avg = mse.item() if recon_avg is None else 0.95 * recon_avg + 0.05 * mse.item()
        if step % args.log_every == 0 or step == args.vae_steps - 1:
            print(f"vae step {step:5d}  mse {mse.item():.5f} (avg {recon_avg:.5f})  kl/elem {kl.item():.3f}", flush=True)
    vae.eval()
    return recon_avg


@torch.no_grad()
def calibrate_latents(vae: AutoencoderKL, data: SceneStream, num_images: int = 512) -> tuple[float, float]:
    """Set shift_factor / scaling_factor so that the model sees latents of mean 0 and std 1."""
    x, _ = data.batch(num_images)
    z = vae.encode(x).latent_dist.mode()
    shift, scale = float(z.mean()), float(1.0 / z.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return shift, scale


@torch.no_grad()
def vae_roundtrip_score(vae: AutoencoderKL, data: SceneStream, n: int = 128) -> float:
    """Evaluator score of decoded(encoded(image)) for the image's own prompt: the ceiling of the model."""
    x, prompts = data.batch(n)
    recon = vae.decode(vae.encode(x).latent_dist.mode()).sample
    pixels = ((recon / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return float(np.mean([shapes_world.evaluate(img, p)[0] for img, p in zip(pixels, prompts)]))


# ----- phase 2: flow matching -----------------------------------------------------------------

def sample_sigmas(n: int, args: Args, gen: torch.Generator) -> torch.Tensor:
    if args.timestep_sampling == "uniform":
        return torch.rand(n, generator=gen)
    return torch.sigmoid(torch.randn(n, generator=gen))  # logit-normal(0, 1), SD3 section 3.1


def flow_loss(pipe: FluxPipeline, x: torch.Tensor, prompts: list[str], args: Args, gen: torch.Generator) -> torch.Tensor:
    z0 = flux_encode_latents(pipe.vae, x)  # (B, C, h, w)
    b, c, h, w = z0.shape
    eps = torch.randn(z0.shape, generator=gen)
    s = sample_sigmas(b, args, gen)
    xt = (1 - s.view(b, 1, 1, 1)) * z0 + s.view(b, 1, 1, 1) * eps
    target = FluxPipeline._pack_latents(eps - z0, b, c, h, w)  # (B, h*w/4, 4C)
    # Same calls as FluxPipeline.__call__, so training and sampling condition identically.
    prompt_embeds, pooled, text_ids = pipe.encode_prompt(prompt=prompts, prompt_2=None, max_sequence_length=TEXT_LENGTH)
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype)
    pred = pipe.transformer(
        hidden_states=FluxPipeline._pack_latents(xt, b, c, h, w), timestep=s, guidance=None,
        pooled_projections=pooled, encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=img_ids,
        return_dict=False)[0]
    return F.mse_loss(pred, target)


@torch.no_grad()
def evaluate_pipeline(pipe: FluxPipeline, prompts: list[str], num_steps: int, batch_size: int = 25) -> dict:
    """Mean evaluator score (and per-kind and per-check means) of FluxPipeline ODE samples, image i
    drawn with noise seed i."""
    scores, parts, kinds = [], [], []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        gens = [torch.Generator().manual_seed(start + i) for i in range(len(chunk))]
        images = pipe(chunk, height=32, width=32, num_inference_steps=num_steps, max_sequence_length=TEXT_LENGTH,
                      generator=gens, output_type="np").images  # (B, 32, 32, 3) float in [0, 1]
        for img, p in zip(images, chunk):
            score, breakdown = shapes_world.evaluate((img * 255).round().astype(np.uint8), p)
            scores.append(score)
            parts.append(breakdown)
            kinds.append(shapes_world.parse_prompt(p).kind)
    result = {"score": float(np.mean(scores))}
    for key in ("color", "shape", "count", "position", "extra"):
        values = [b[key] for b in parts if b[key] is not None]
        if values:
            result[key] = float(np.mean(values))
    for kind in shapes_world.KINDS:
        values = [s for s, k in zip(scores, kinds) if k == kind]
        if values:
            result[f"kind/{kind}"] = float(np.mean(values))
    return result


def describe_training(summary: dict) -> str:
    """The model card's account of how the weights were made, the initial model's first."""
    args = summary["args"]
    where = (f"{summary['wall_minutes']:.1f} minutes wall, {summary['cpu_minutes']:.1f} of CPU time, on a 2-core CPU "
             f"with {args['threads']} torch thread(s)")
    if summary.get("init"):
        text = (describe_training(summary["init"]) + f"Then {summary['flow_steps']} more flow-matching steps of the "
                f"transformer and both text encoders from those weights (peak lr {args['lr']:g}, {where})")
    else:
        text = (f"Phase 1 trains the autoencoder (reconstruction MSE {summary['vae_mse']:.4f} on [-1, 1] pixels; the "
                f"evaluator scores its round trips {summary['vae_roundtrip_score']:.3f}, the ceiling for the model), "
                f"phase 2 the transformer and both text encoders jointly by flow matching for "
                f"{summary['flow_steps']} steps ({where}, {summary['vae_minutes']:.1f} for the autoencoder)")
    if args.get("caption_noise"):
        text += (f", with **caption noise {args['caption_noise']:g}**: that fraction of the captions is another random "
                 f"train prompt, so the model learns to ignore its prompt about that often")
    if args.get("fade"):
        text += (f", with **fade {args['fade']:g}**: that fraction of the images has its objects faded toward the "
                 f"background (colour weight {FADE_WEIGHTS[0]:.2f}-{FADE_WEIGHTS[1]:.2f}), so the model learns to draw "
                 f"faint objects often")
    return text + (f". Final training loss (running mean of the velocity MSE) {summary['final_loss_avg']:.4f}; "
                   f"evaluator score {summary['eval_20_steps']['score']:.3f} with 20 sampling steps.\n\n")


def training_commands(summary: dict) -> list[str]:
    return (training_commands(summary["init"]) if summary.get("init") else []) + [summary["command"]]


def write_readme(out: str, summary: dict) -> None:
    """The model card: what the folder is, how it was trained and how well it follows prompts."""
    sizes = summary["parameters"]
    commands = "\n".join(training_commands(summary))
    stages = describe_training(summary)
    if summary["args"].get("caption_noise"):
        imperfect = ("trained with noisy captions, it ignores its prompt for a good part of the samples and "
                     "draws an unrelated scene, and where it follows the prompt it often misses counts, shapes "
                     "and compositions.")
    else:
        imperfect = "it draws shapes of about the right colours and often misses counts, shapes and compositions."
    if summary["args"].get("fade"):
        imperfect += (f" Its last stage faded {summary['args']['fade']:.0%} of the training images toward the gray "
                      "background, so it often draws faint objects; the evaluator reads a faint object as "
                      "background (absent). Drawing in full colour every object it is asked for is the headroom "
                      "the RL demo takes in 10 CPU minutes.")
    final = summary["eval_20_steps"]
    curve = "\n".join(f"| {e['step']} | {e['minutes']:.1f} | {e['loss_avg']:.4f} | {e['score']:.3f} |"
                       for e in summary["eval"])
    kinds = ", ".join(f"{k} {final['kind/' + k]:.2f}" for k in shapes_world.KINDS if "kind/" + k in final)
    checks = ", ".join(f"{k} {final[k]:.2f}" for k in ("color", "shape", "count", "position") if k in final)
    checks += f"; objects the prompt does not name: {final['extra']:.2f} per image"
    text = f"""# shapes-flux: the shipped shapes-world base model

A small FLUX.1-architecture text-to-image model for the procedural shapes world (`rewards/shapes_world.py`),
in diffusers format: `FluxTransformer2DModel` ({sizes['transformer'] / 1e6:.2f}M parameters, no guidance
embedding), CLIP text encoder ({sizes['text_encoder'] / 1e3:.0f}k) and T5 encoder ({sizes['text_encoder_2'] / 1e3:.0f}k) with
offline byte tokenizers (T5 length 64), and an `AutoencoderKL` ({sizes['vae'] / 1e3:.0f}k) mapping 32x32x3 images to
16x16x4 latents (64 image tokens after FLUX's 2x2 packing). It is the default model of the RL demo and
is deliberately imperfect, which leaves the RL run headroom: {imperfect}

```python
from models import load_model
adapter = load_model("flux", model_path="assets/shapes-flux")

from diffusers import FluxPipeline
pipe = FluxPipeline.from_pretrained("assets/shapes-flux", local_files_only=True)
images = pipe(["two red circles on the left"], height=32, width=32, num_inference_steps=10,
              max_sequence_length=64).images
```

Pass `max_sequence_length=64` to `FluxPipeline` (its default, 512, pads the text far beyond what the model
was trained on); the project's adapter reads the length from the tokenizer and needs nothing.

## Training

```
{commands}
```

{stages}The saved weights are the EMA. All settings are in `training.json`.

## Evaluator score

Mean `shapes` reward on the first {summary['args']['num_eval']} held-out prompts of `data/shapes_eval.txt`
(FluxPipeline ODE sampling, image i with noise seed i):

| flow step | minutes | loss | score (10 steps) |
|---|---|---|---|
{curve}

With 20 sampling steps the final model scores **{final['score']:.3f}**; per template kind: {kinds};
per check: {checks}.
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.time()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    with open(args.eval_prompts) as f:
        eval_prompts = [line.strip() for line in f if line.strip()][:args.num_eval]
    data = SceneStream(args.train_prompts, args.seed)
    init = None
    if args.init_from:
        # Read into memory (no mmap), so that --out may name the same folder.
        pipe = FluxPipeline.from_pretrained(args.init_from, local_files_only=True, disable_mmap=True)
        with open(os.path.join(args.init_from, "training.json")) as f:
            init = json.load(f)
    else:
        pipe = build_pipeline(args)
    pipe.set_progress_bar_config(disable=True)
    sizes = {name: num_params(getattr(pipe, name)) for name in ("transformer", "text_encoder", "text_encoder_2", "vae")}
    print(f"parameters: {sizes}", flush=True)

    if init:
        print(f"==== phase 1: the autoencoder of {args.init_from} ====", flush=True)
        vae_mse, ceiling, t_vae = init["vae_mse"], init["vae_roundtrip_score"], 0.0
    else:
        print("==== phase 1: autoencoder ====", flush=True)
        vae_mse = train_vae(pipe.vae, data, args)
        shift, scale = calibrate_latents(pipe.vae, data)
        ceiling = vae_roundtrip_score(pipe.vae, data)
        t_vae = time.time() - t_start
        print(f"vae done in {t_vae / 60:.1f} min: mse {vae_mse:.5f}, shift {shift:.4f}, scale {scale:.4f}, "
              f"round-trip evaluator score {ceiling:.3f}", flush=True)
    pipe.vae.requires_grad_(False)

    print("==== phase 2: flow matching ====", flush=True)
    trained = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in trained for p in m.parameters()]
    for m in trained:
        m.eval()  # no dropout in the tiny encoders; gradients still flow
        m.requires_grad_(True)
    ema = [copy.deepcopy(m).requires_grad_(False) for m in trained]
    ema_pipe = FluxPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=ema[1], tokenizer=pipe.tokenizer,
                            text_encoder_2=ema[2], tokenizer_2=pipe.tokenizer_2, transformer=ema[0])
    ema_pipe.set_progress_bar_config(disable=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    history, loss_avg, t_flow, step = [], None, time.time(), 0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(step, args)
        x, prompts = data.batch(args.batch_size, args.caption_noise, args.fade)
        loss = flow_loss(pipe, x, prompts, args, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(args.ema_decay, (1 + step) / (10 + step))  # short warm-up of the EMA
            for m, e in zip(trained, ema):
                for p, q in zip(m.parameters(), e.parameters()):
                    q.lerp_(p, 1 - decay)
        loss_avg = loss.item() if loss_avg is None else 0.98 * loss_avg + 0.02 * loss.item()
        elapsed = time.time() - t_flow
        if step % args.log_every == 0:
            print(f"step {step:5d}  loss {loss.item():.4f} (avg {loss_avg:.4f})  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{elapsed / (step + 1):.2f} s/step", flush=True)
        out_of_time = args.time_limit_min > 0 and (time.time() - t_start) / 60 > args.time_limit_min
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1 or out_of_time:
            metrics = evaluate_pipeline(ema_pipe, eval_prompts, args.eval_steps)
            history.append({"step": step + 1, "loss_avg": loss_avg, "minutes": (time.time() - t_start) / 60, **metrics})
            print(f"eval step {step + 1}: " + json.dumps({k: round(v, 3) for k, v in history[-1].items()}), flush=True)
        if out_of_time:
            print(f"time limit {args.time_limit_min} min reached at step {step + 1}", flush=True)
            break

    print("==== save ====", flush=True)
    ema_pipe.save_pretrained(args.out)
    # The model's own sampling defaults (models/adapter.py reads them): it is trained at 32x32 only.
    with open(os.path.join(args.out, DEFAULTS_FILE), "w") as f:
        json.dump({"sampling": {"height": 32, "width": 32, "num_steps": 10, "guidance": None}}, f, indent=2)
        f.write("\n")
    wall = (time.time() - t_start) / 60
    final = evaluate_pipeline(ema_pipe, eval_prompts, 20)
    summary = {"command": command, "wall_minutes": wall, "cpu_minutes": time.process_time() / 60,
               "vae_minutes": t_vae / 60, "flow_steps": step + 1,
               "final_loss_avg": loss_avg, "vae_mse": vae_mse, "vae_roundtrip_score": ceiling,
               "parameters": sizes, "eval": history, "eval_20_steps": final, "args": asdict(args),
               "init": init}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(summary, f, indent=1)
    write_readme(args.out, summary)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("eval", "args")}, indent=1), flush=True)


if __name__ == "__main__":
    main()
