"""Per-prompt shapes (docs/DESIGN.md 5.8): production RL trains on bucketed resolutions and frame
counts. A .jsonl prompt may carry its own `height`, `width` and (video) `frames`; the run's
--height, --width and --num-frames stay the default for prompts without them, and a group keeps its
prompt's shape. This module resolves each prompt's shape key (height, width, frames), checks every
shape against the model's patch and VAE factors before any rank waits, and builds the plan's
`ShapeTable`: every prompt's key and the predicted cost of one sample of each shape.
"""
from __future__ import annotations

import dataclasses

from rl import sampler
from parallel.stepplan import ATTENTION_WIDTH, ShapeTable, sample_cost

Shape = tuple  # (height, width, frames or None)


def default_shape(sampling: sampler.SamplingConfig) -> Shape:
    return (sampling.height, sampling.width, sampling.num_frames)


def record_shape(record, default: Shape) -> Shape:
    """A prompt's shape: its own fields, the run's default for the ones it leaves out."""
    m = record.metadata
    return (m.get("height", default[0]), m.get("width", default[1]), m.get("frames", default[2]))


def shape_name(shape: Shape) -> str:
    """"32x48" (height x width) or, for video, "33x480x832" (frames x height x width)."""
    h, w, f = shape
    return f"{h}x{w}" if f is None else f"{f}x{h}x{w}"


def rows_by_shape(records, sampling: sampler.SamplingConfig) -> dict[Shape, list[int]]:
    """Record indices grouped by shape, each group in record order and the groups in order of first
    appearance: batches of one shape, as training and evaluation sample them."""
    default = default_shape(sampling)
    out: dict[Shape, list[int]] = {}
    for j, r in enumerate(records):
        out.setdefault(record_shape(r, default), []).append(j)
    return out


def sampling_for(sampling: sampler.SamplingConfig, shape: Shape | None) -> sampler.SamplingConfig:
    """The run's sampling config at another shape (None: the run's own)."""
    if shape is None:
        return sampling
    return dataclasses.replace(sampling, height=shape[0], width=shape[1], num_frames=shape[2])


def check_shapes(adapter, records, sampling: sampler.SamplingConfig, path: str) -> dict[Shape, int]:
    """Every distinct shape of `records` checked against the model (its patch and VAE factors, its
    frame rules, the timestep schedule it gets): a bad one is a ValueError naming the prompt file,
    the line of the first prompt with that shape and the bad value. Returns each shape's tokens per
    sample."""
    default = default_shape(sampling)
    video = adapter.defaults.num_frames is not None
    tokens: dict[Shape, int] = {}
    for r in records:
        shape = record_shape(r, default)
        if shape in tokens:
            continue
        where = f"{path}:{r.line}" if r.line else path
        if "frames" in r.metadata and not video:
            raise ValueError(f"{where}: 'frames' {r.metadata['frames']} given for {adapter.family!r}, an image model")
        try:
            tokens[shape] = adapter.image_seq_len(adapter.latent_shape(*shape))
            if sampling.schedule == "dynamic":  # the timesteps shift by the sample's size
                sampler.check_schedule(dict(sampler.flow_scheduler(adapter).config), sampling.num_steps, tokens[shape])
        except ValueError as e:
            own = [k for k in ("height", "width", "frames") if k in r.metadata]
            what = f"prompt shape {shape_name(shape)}" if own else "the run's --height/--width/--num-frames"
            raise ValueError(f"{where}: {what}: {e}") from None
    return tokens


def attention_width(adapter) -> float:
    """C of the cost model (parallel.plan.ATTENTION_WIDTH): 6 x the transformer's width."""
    config = adapter.transformer.config
    heads, dim = getattr(config, "num_attention_heads", None), getattr(config, "attention_head_dim", None)
    return 6.0 * heads * dim if isinstance(heads, int) and isinstance(dim, int) else float(ATTENTION_WIDTH)


def shape_table(adapter, records, sampling: sampler.SamplingConfig, path: str) -> ShapeTable | None:
    """The plan's shapes of a prompt set (checked first, see `check_shapes`); None when every
    prompt has the run's default shape, so a one-shape run plans exactly as before."""
    tokens = check_shapes(adapter, records, sampling, path)
    default = default_shape(sampling)
    keys = tuple(record_shape(r, default) for r in records)
    if all(k == default for k in keys):
        return None
    width = attention_width(adapter)
    return ShapeTable(keys, {k: sample_cost(n, sampling.num_steps, width) for k, n in tokens.items()})


def evaluation_share(keys: list, num_evaluators: int, me: int) -> list[tuple[int, bool]]:
    """The records evaluator `me` samples, as (record index, real): an equal contiguous slice of
    each shape's records, padded with that shape's last record (real False) so that every
    evaluator runs equally many forwards of every shape (FSDP all-gathers pair up). One shape: the
    records split into equal contiguous slices."""
    by_shape: dict = {}
    for j, key in enumerate(keys):
        by_shape.setdefault(key, []).append(j)
    out = []
    for rows in by_shape.values():
        per = -(-len(rows) // num_evaluators)
        part = rows[me * per:(me + 1) * per]
        out += [(j, True) for j in part] + [(rows[-1], False)] * (per - len(part))
    return out


def measured_table(table: ShapeTable | None, seconds_by_rank: list[dict[str, float]]) -> ShapeTable | None:
    """The table calibrated by measurement: each generator rank timed a chunk at every shape
    (capacity.probe_shapes, keyed by shape_name); their mean seconds are fitted by least squares as
    a + b x the analytic cost (a >= 0: the fixed cost of a chunk that FLOPs do not see; b > 0), and
    each shape's cost becomes a + b x its analytic cost, relative to the largest. The order of the
    shapes stays the model's (more tokens never cost less), so measurement noise moves only the
    balance; every rank fits the same gathered numbers and plans alike. A fit with no positive
    slope (fixed costs dominate, or noise) makes the shapes cost about the same: still ordered by
    the model, balanced by count."""
    if table is None:
        return None
    names = {shape_name(k): k for k in table.costs}
    if not seconds_by_rank or any(set(s) != set(names) for s in seconds_by_rank):
        raise ValueError(f"every generator rank must measure the shapes {sorted(names)}")
    xs = [float(table.costs[names[n]]) for n in names]
    ys = [sum(s[n] for s in seconds_by_rank) / len(seconds_by_rank) for n in names]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    a = my - b * mx
    if a < 0:  # through the origin: no fixed cost
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    if not b > 0:
        a, b = my, 1e-6 * my / max(xs)
    top = a + b * max(xs)
    return ShapeTable(table.keys, {names[n]: (a + b * x) / top for n, x in zip(names, xs)})
