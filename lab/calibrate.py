"""Calibration probe: measure this device's per-block costs for the planner (docs/calibration.md,
"Calibration probe").

    python -m lab.calibrate --model flux --out profile.json
    torchrun --standalone --nproc_per_node 8 -m lab.calibrate --model flux --out profile.json  # + all-gathers

For micro-batches 1..N it times every DiT block's forward and forward + backward (inputs and
weights requiring gradients; with --lora-rank R, peft LoRA adapters on frozen weights, as a LoRA
run trains and generates), counts each block's FLOPs with torch's FlopCounterMode, and times the
parts outside the blocks (embedding and head). Under torchrun it also times an all-gather of each
block's bf16 weights over all ranks. The profile it writes is read by the planner
(lab/planning/profile.py; `scripts/plan.py --profile FILE`) in place of the datasheet efficiency and
bus bandwidth of the GPU it names.

Which model: on CUDA, the released transformer with random weights in bf16 (FLUX.1-dev's; the other
families use their tiny preset unless --model-path is given), built on the meta device and made on
the GPU in bf16 (nothing in float32, nothing on the host), timed at the released model's token
counts: at --height/--width 512 FLUX.1-dev sees 1024 image tokens (VAE factor 8, 2x2 packing) and
512 text tokens (its T5 length), the conditioning made at the text encoders' output shapes. On CPU
it measures the shipped shapes model (flux) or the family's tiny preset, at their own token counts
(the shipped model at 32 x 32: 64 image + 64 text tokens). The output and the profile say which
tokens were measured. Timings synchronize the device before and after each measurement and keep
the median of --repeats runs after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from config import cli
from models import load_model, model_names, resolve_device
from models.lora import apply_lora
from models.released import meta_adapter
from rl.conditioning import Conditioning, State

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


FORMAT = "digenrl-device-profile/1"

RELEASED = {"flux": "flux1_dev"}
"""--preset released: the released model (models/configs) whose transformer a family's probe times"""


def released_adapter(family: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The released model of `family`, its transformer made on `device` in `dtype` with random
    weights (normal, std 0.02) from the meta device, nothing else made: the text encoders and the
    VAE stay on meta, their configs and the released tokenizer lengths give the shapes."""
    adapter = meta_adapter(RELEASED[family])
    transformer = adapter.transformer.to(dtype).to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in transformer.parameters():
            p.normal_(0.0, 0.02)
        for b in transformer.buffers():
            b.zero_()
    return adapter


def released_conditioning(adapter, batch: int, text_tokens: int | None) -> Conditioning:
    """What FLUX's text encoders hand the transformer, at their output shapes (zeros): the T5 states
    at the released text length (or `text_tokens`) and the pooled CLIP embedding."""
    config, like = adapter.transformer.config, {"device": adapter.device, "dtype": adapter.dtype}
    length = text_tokens or adapter.max_sequence_length
    return Conditioning({"prompt_embeds": torch.zeros(batch, length, config.joint_attention_dim, **like),
                         "pooled": torch.zeros(batch, config.pooled_projection_dim, **like)})


GPU_NAMES = {"H100": "h100", "H800": "h800", "H200": "h200", "H20": "h20", "A100": "a100", "L40S": "l40s"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (kernels, allocator)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(args, device: torch.device, dtype: torch.dtype):
    """The adapter to measure and a description of what it is."""
    if args.model_path:
        return load_model(args.model, args.model_path, dtype=dtype, device=device), f"folder {args.model_path}"
    preset = args.preset
    if preset == "auto":
        preset = "released" if device.type == "cuda" and args.model in RELEASED else "tiny"
        if device.type != "cuda" and args.model == "flux":
            shipped = os.path.join(ROOT, "assets", "shapes-flux")
            if os.path.isdir(shipped):
                return load_model("flux", shipped, dtype=dtype, device=device), "shipped shapes model"
    if preset == "released":
        if args.model not in RELEASED:
            raise ValueError(f"--preset released is available for {sorted(RELEASED)}; use --model-path for "
                             f"{args.model!r}")
        return released_adapter(args.model, device, dtype), f"released {RELEASED[args.model]}, random weights"
    return load_model(args.model, preset=preset, dtype=dtype, device=device), f"{preset} preset"


def conditioning(adapter, batch: int, text_tokens: int | None) -> Conditioning:
    if not any(adapter.holds(name) for name in adapter.text_encoders()):  # the released model's stay on meta
        return released_conditioning(adapter, batch, text_tokens)
    cond = adapter.encode_prompts(["a red circle above a blue square"] * batch)
    if text_tokens is None:
        return cond
    out = {}
    for k, v in cond.tensors.items():
        if v.dim() >= 2 and k in ("prompt_embeds", "encoder_hidden_states", "text"):
            pad = text_tokens - v.shape[1]
            v = torch.cat([v, v.new_zeros(v.shape[0], pad, *v.shape[2:])], 1) if pad > 0 else v[:, :text_tokens]
        out[k] = v
    return Conditioning(out)


def _detach_state(state: State, grad: bool) -> State:
    acts = {k: (v.detach().requires_grad_(grad and v.is_floating_point()) if torch.is_tensor(v) else v)
            for k, v in state.acts.items()}
    return State(acts, state.side)


def _loss(state: State):
    return sum(v.float().sum() for v in state.acts.values() if torch.is_tensor(v) and v.requires_grad)


def measure(adapter, args, device: torch.device) -> dict:
    shape = adapter.latent_shape(args.height, args.width, args.frames)
    batches = list(range(1, args.max_batch + 1))
    fwd, fwd_bwd, flops, outside = [], [], [], []
    for b in batches:
        cond = conditioning(adapter, b, args.text_tokens)
        x = torch.randn(b, *shape, device=device, dtype=adapter.dtype)
        sigma = torch.full((b,), 0.5, device=device)
        with torch.no_grad():
            state = adapter.embed(x, sigma, cond)
            embed_s = _timed(lambda: adapter.embed(x, sigma, cond), device, args.repeats)
        row_f, row_fb, row_flops = [], [], []
        for i in range(len(adapter.blocks)):
            inp = _detach_state(state, False)
            with torch.no_grad():
                row_f.append(_timed(lambda: adapter.run_block(i, inp), device, args.repeats))
                with FlopCounterMode(display=False) as counter:
                    out = adapter.run_block(i, inp)
                row_flops.append(float(counter.get_total_flops()))

            def step(i=i):
                s = _detach_state(state, True)
                _loss(adapter.run_block(i, s)).backward()
            if not args.lora_rank:  # full fine-tuning: every weight of the block trains
                for p in adapter.blocks[i].parameters():
                    p.requires_grad_(True)
            row_fb.append(_timed(step, device, args.repeats))
            adapter.blocks[i].zero_grad(set_to_none=True)
            state = _detach_state(out, False)
        with torch.no_grad():
            head_s = _timed(lambda: adapter.head(state), device, args.repeats)
        fwd.append(row_f)
        fwd_bwd.append(row_fb)
        flops.append(row_flops)
        outside.append(embed_s + head_s)
    seq = (state.acts["hidden"].shape[1] if "hidden" in state.acts else None)
    tokens, image = _tokens(state, seq), adapter.image_seq_len(shape)
    return {"batches": batches, "forward_s": fwd, "forward_backward_s": fwd_bwd, "flops": flops,
            "outside_blocks_forward_s": outside, "tokens_per_sample": tokens, "image_tokens": image,
            "text_tokens": tokens - image,
            "blocks": [{"index": i, "params": int(sum(p.numel() for p in blk.parameters()))}
                       for i, blk in enumerate(adapter.blocks)]}


def _tokens(state: State, seq: int | None) -> int:
    """Image + text tokens a block sees per sample."""
    total = 0
    for k in ("hidden", "text"):
        v = state.acts.get(k)
        if torch.is_tensor(v) and v.dim() == 3:
            total += v.shape[1]
    return total or int(seq or 0)


def measure_allgather(profile_blocks: list[dict], device: torch.device, repeats: int) -> dict | None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    world = dist.get_world_size()
    sizes = sorted({b["params"] for b in profile_blocks})
    seconds, num_bytes = [], []
    for n in sizes:
        shard = -(-n // world)
        src = torch.zeros(shard, dtype=torch.bfloat16, device=device)
        dst = torch.empty(shard * world, dtype=torch.bfloat16, device=device)
        seconds.append(_timed(lambda: dist.all_gather_into_tensor(dst, src), device, repeats))
        num_bytes.append(2 * shard * world)
    return {"group": world, "bytes": num_bytes, "seconds": seconds}




def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def guess_gpu_key(name: str) -> str | None:
    for token, key in GPU_NAMES.items():
        if token in name.upper().split() or token in name.upper().replace("-", " ").split():
            return key
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", default="flux", choices=model_names(), help="model family")
    p.add_argument("--model-path", default=None, help="a local diffusers folder to measure instead")
    p.add_argument("--preset", default="auto", choices=("auto", "tiny", "mid", "released"),
                   help="auto: the released model on CUDA (FLUX.1-dev, random bf16 weights made on the GPU), the "
                        "shipped or tiny model on CPU")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--max-batch", type=int, default=4, help="micro-batches 1..N are measured")
    p.add_argument("--height", type=int, default=None,
                   help="pixels; default: 512 for released (FLUX.1-dev: 1024 image tokens; 1024 px: 4096), 32 "
                        "otherwise (the shipped and tiny models: 64)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="video families: frames per sample")
    p.add_argument("--text-tokens", type=int, default=None,
                   help="text tokens per sample; default: the model's text length (FLUX.1-dev: 512, the shipped "
                        "and tiny models: 64)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="time training as LoRA of this rank trains (frozen weights, adapters on --lora-targets); "
                        "0: full fine-tuning")
    p.add_argument("--lora-targets", default="attn", choices=("attn", "attn+ff"))
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median kept)")
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-key", default=None, help="the planner GPU this profile replaces (default: from the name)")
    args = p.parse_args(argv)
    if args.max_batch < 1 or args.repeats < 1 or args.lora_rank < 0:
        p.error("--max-batch and --repeats must be >= 1, --lora-rank >= 0")
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = resolve_device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    released = args.preset == "released" or (args.preset == "auto" and device.type == "cuda")
    args.height = args.height or (512 if released else 32)
    args.width = args.width or (512 if released else 32)
    torch.manual_seed(0)
    adapter, what = build(args, device, dtype)
    if args.lora_rank:
        apply_lora(adapter.transformer, args.lora_rank, None, args.lora_targets)
    result = measure(adapter, args, device)
    result["allgather"] = measure_allgather(result["blocks"], device, args.repeats)
    name = device_name(device)
    profile = {"format": FORMAT, "device": name, "device_type": device.type,
               "gpu_key": args.gpu_key or (guess_gpu_key(name) if device.type == "cuda" else None),
               "model": args.model, "what": what, "dtype": str(dtype).replace("torch.", ""),
               "height": args.height, "width": args.width, "frames": args.frames,
               "finetune": f"lora:{args.lora_rank}:{args.lora_targets}" if args.lora_rank else "full",
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(profile, f, indent=1)
        total = [sum(r) + o for r, o in zip(result["forward_s"], result["outside_blocks_forward_s"])]
        print(f"{name}: {what}, {len(result['blocks'])} blocks, {args.height} x {args.width} px: "
              f"{result['image_tokens']} image + {result['text_tokens']} text tokens per sample")
        for b, t, tb, fl in zip(result["batches"], total, result["forward_backward_s"], result["flops"]):
            print(f"  batch {b}: forward {t * 1e3:.2f} ms, blocks forward+backward {sum(tb) * 1e3:.2f} ms, "
                  f"{sum(fl) / max(sum(result['forward_s'][b - 1]), 1e-12) / 1e12:.3f} TFLOP/s in the blocks")
        print(f"wrote {args.out}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    cli.run(main)
