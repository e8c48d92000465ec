"""Encode prompt files once, so that a run needs no text encoder (as DanceGRPO precomputes its
prompt embeddings): every prompt's conditioning goes to one safetensors file that the run reads with
--prompt-embeds FILE (prompts/embeds.py).

    python -m scripts.encode_prompts --model flux --model-path /weights/FLUX.1-dev \\
        --prompts data/train.txt --prompts data/eval.txt --out embeds/flux-dev.safetensors

Encode every prompt file the run reads (training and evaluation prompts); the empty prompt is always
included (CFG's unconditional branch, the start-up probes), and --negative-prompt adds a run's
negative prompt. Only the text encoders load (in --dtype, on --device): the transformer and the VAE
are not read. Encode on the GPU type the run uses and in its compute dtype, so that the embeddings
equal what the run would compute on the fly (a batch of one or of many gives the same rows: the
conditioning is padded to a fixed length). The file records its encoder (the model folder and the
digest of its text encoders' files, or the preset and seed) and each tensor's dimensions; a run whose
model's text encoders differ refuses it before any rank waits.
"""
from __future__ import annotations

import argparse

from models import load_model, model_dtypes, model_names, resolve_device
from prompts import embeds
from prompts.sets import load_prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", default="flux", help=f"model family, one of {model_names()}")
    p.add_argument("--model-path", default=None, help="local diffusers folder (default: the tiny preset)")
    p.add_argument("--preset", default="tiny", help="without --model-path: the random preset (tiny, mid)")
    p.add_argument("--seed", type=int, default=0, help="the presets' seed (the run's --seed)")
    p.add_argument("--prompts", action="append", required=True, help="prompt file (.txt or .jsonl), repeatable")
    p.add_argument("--negative-prompt", default="", help="the run's --negative-prompt, if any")
    p.add_argument("--dtype", default="auto", help="the run's --dtype (the text encoders run in its compute dtype)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", required=True, help="the safetensors file to write")
    args = p.parse_args(argv)

    prompts = ["", args.negative_prompt] + [r.prompt for path in args.prompts for r in load_prompts(path)]
    device = resolve_device(args.device)
    adapter = load_model(args.model, args.model_path, preset=args.preset, seed=args.seed,
                         dtype=model_dtypes(args.dtype, device, master=False), device=device,
                         release=("transformer", "vae"))
    rows = embeds.encode_all(adapter, prompts, args.batch_size)
    embeds.save(args.out, rows, adapter.family, adapter.max_sequence_length,
                embeds.encoder_record(args.model_path, args.preset, args.seed))
    print(f"{len(rows)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
