"""The shapes world: a procedural scene sampler and renderer, its prompt grammar, and a GenEval-like
evaluator that checks an image against a prompt with simple image processing.

One module, shared by the `shapes` reward, the prompt data sets and the base model's pretraining, so
that the three always agree on what a prompt means.

Images are 32x32 RGB uint8 on a mid-gray background. Prompts follow exactly four templates, each
optionally followed by a position phrase:

    a {color} {shape}
    two {color} {shape}s
    three {color} {shape}s
    a {color} {shape} and a {color} {shape}
    ... + " on the left" | " on the right" | " on the top" | " on the bottom"

Position is absolute: "on the left" means every object the prompt names lies in the left half of
the image (its centroid has x < W/2); "top" is the upper half (row 0 is the top row). In a
two-object prompt the phrase applies to both objects.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import numpy as np
import torch

SIZE = 32  # image height and width in pixels
BACKGROUND = (128, 128, 128)
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (25, 180, 25),
    "blue": (25, 60, 230),
    "yellow": (235, 220, 30),
    "magenta": (220, 40, 200),
    "cyan": (30, 210, 220),
}
COLORS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("left", "right", "top", "bottom")
NUMBER_WORDS = {1: "a", 2: "two", 3: "three"}
KINDS = ("one", "two", "three", "pair")  # the four templates, in the order listed above

# Object side lengths (bounding-box pixels). Below 8 px a triangle and a circle stop being told
# apart reliably by their fill ratio; 13 px lets three objects share the image comfortably.
MIN_OBJECT_SIZE, MAX_OBJECT_SIZE = 8, 13
GAP = 2  # empty pixels kept between objects' boxes, so 8-connected components never merge


# ----- prompts ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ObjectSpec:
    color: str
    shape: str
    count: int = 1


@dataclass(frozen=True)
class Spec:
    """What a prompt asks for: one or two object groups and an optional image half."""

    objects: tuple[ObjectSpec, ...]
    position: str | None = None

    @property
    def kind(self) -> str:
        if len(self.objects) == 2:
            return "pair"
        return {1: "one", 2: "two", 3: "three"}[self.objects[0].count]


def spec_to_prompt(spec: Spec) -> str:
    if len(spec.objects) == 2:
        a, b = spec.objects
        text = f"a {a.color} {a.shape} and a {b.color} {b.shape}"
    else:
        (o,) = spec.objects
        text = f"{NUMBER_WORDS[o.count]} {o.color} {o.shape}" + ("s" if o.count > 1 else "")
    return text + (f" on the {spec.position}" if spec.position else "")


_COLOR = "|".join(COLORS)
_SHAPE = "|".join(SHAPES)
_PHRASE = re.compile(
    rf"^(?:(?P<num>a|two|three) (?P<c>{_COLOR}) (?P<s>{_SHAPE})(?P<plural>s?)"
    rf"|a (?P<c1>{_COLOR}) (?P<s1>{_SHAPE}) and a (?P<c2>{_COLOR}) (?P<s2>{_SHAPE}))"
    rf"(?: on the (?P<pos>{'|'.join(POSITIONS)}))?$")


def parse_prompt(prompt: str) -> Spec:
    """The Spec of a grammar prompt (case and repeated spaces are ignored); ValueError otherwise."""
    text = " ".join(prompt.strip().lower().split())
    m = _PHRASE.match(text)
    if m is not None and m["num"] is not None and (m["plural"] == "s") != (m["num"] != "a"):
        m = None  # "a red circles" or "two red circle"
    if m is None:
        raise ValueError(
            f"prompt {prompt!r} is not in the shapes-world grammar: expected 'a|two|three COLOR SHAPE(s)' or "
            f"'a COLOR SHAPE and a COLOR SHAPE', optionally + ' on the left|right|top|bottom'; "
            f"colors {list(COLORS)}, shapes {list(SHAPES)}")
    if m["num"] is not None:
        count = {"a": 1, "two": 2, "three": 3}[m["num"]]
        objects = (ObjectSpec(m["c"], m["s"], count),)
    else:
        objects = (ObjectSpec(m["c1"], m["s1"]), ObjectSpec(m["c2"], m["s2"]))
    return Spec(objects, m["pos"])


def all_specs() -> list[Spec]:
    """Every prompt of the grammar, in a fixed order (pairs of two identical objects excluded:
    'two ...' says that)."""
    singles = [ObjectSpec(c, s, n) for n in (1, 2, 3) for c in COLORS for s in SHAPES]
    units = [ObjectSpec(c, s) for c in COLORS for s in SHAPES]
    pairs = [(a, b) for a, b in itertools.product(units, units) if a != b]
    bodies = [(o,) for o in singles] + pairs
    return [Spec(body, pos) for pos in (None, *POSITIONS) for body in bodies]


def sample_spec(rng: np.random.Generator) -> Spec:
    """A random prompt: template kind uniform, then colors, shapes and position (None or one of four)."""
    def pick(count: int = 1) -> ObjectSpec:
        return ObjectSpec(COLORS[rng.integers(len(COLORS))], SHAPES[rng.integers(len(SHAPES))], count)

    kind = KINDS[rng.integers(len(KINDS))]
    if kind == "pair":
        first, second = pick(), pick()
        while second == first:
            second = pick()
        objects = (first, second)
    else:
        objects = (pick(KINDS.index(kind) + 1),)
    options = (None, *POSITIONS)
    return Spec(objects, options[rng.integers(len(options))])


# ----- scenes and rendering ------------------------------------------------------------------

@dataclass(frozen=True)
class SceneObject:
    color: str
    shape: str
    x: int  # left column of the bounding box
    y: int  # top row of the bounding box
    size: int  # side of the (square) bounding box


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    position: str | None = None  # the image half all objects were placed in
    height: int = SIZE
    width: int = SIZE
    # Order of object groups for the prompt ("a red circle and a blue square" vs. the reverse).
    group_order: tuple[tuple[str, str], ...] = field(default=())


def _region(position: str | None, height: int, width: int) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1), exclusive ends, where boxes may lie: the image minus a 1-pixel margin,
    cut to the named half."""
    x0, y0, x1, y1 = 1, 1, width - 1, height - 1
    if position == "left":
        x1 = width // 2
    elif position == "right":
        x0 = width // 2
    elif position == "top":
        y1 = height // 2
    elif position == "bottom":
        y0 = height // 2
    return x0, y0, x1, y1


def sample_scene(rng: np.random.Generator, spec: Spec | None = None, height: int = SIZE, width: int = SIZE) -> Scene:
    """Random non-overlapping placement of the objects of `spec` (a random spec when None)."""
    spec = sample_spec(rng) if spec is None else spec
    units = [(o.color, o.shape) for o in spec.objects for _ in range(o.count)]
    x0, y0, x1, y1 = _region(spec.position, height, width)
    max_size = min(MAX_OBJECT_SIZE, x1 - x0, y1 - y0)
    for _ in range(1000):
        # Place objects one by one, each uniformly among the positions still free; restart when one
        # has no room left, and shrink the largest size allowed as restarts pile up (crowded halves).
        boxes: list[tuple[int, int, int]] = []
        for _unit in units:
            size = int(rng.integers(MIN_OBJECT_SIZE, max_size + 1))
            xs, ys = np.meshgrid(np.arange(x0, x1 - size + 1), np.arange(y0, y1 - size + 1), indexing="xy")
            free = np.ones(xs.shape, dtype=bool)
            for bx, by, bsz in boxes:
                free &= ~((xs < bx + bsz + GAP) & (bx < xs + size + GAP) & (ys < by + bsz + GAP) & (by < ys + size + GAP))
            if not free.any():
                break
            choice = int(rng.integers(free.sum()))
            boxes.append((int(xs[free][choice]), int(ys[free][choice]), size))
        if len(boxes) == len(units):
            objects = tuple(SceneObject(c, s, x, y, sz) for (c, s), (x, y, sz) in zip(units, boxes))
            order = tuple((o.color, o.shape) for o in spec.objects)
            return Scene(objects, spec.position, height, width, order)
        max_size = max(MIN_OBJECT_SIZE, max_size - 1)
    raise ValueError(f"cannot place {len(units)} objects in region {(x0, y0, x1, y1)} of a {height}x{width} image")


def scene_to_spec(scene: Scene) -> Spec:
    counts: dict[tuple[str, str], int] = {}
    for o in scene.objects:
        counts[(o.color, o.shape)] = counts.get((o.color, o.shape), 0) + 1
    order = list(scene.group_order) or list(counts)
    return Spec(tuple(ObjectSpec(c, s, counts[(c, s)]) for c, s in order), scene.position)


def scene_to_prompt(scene: Scene) -> str:
    return spec_to_prompt(scene_to_spec(scene))


def shape_mask(shape: str, size: int) -> np.ndarray:
    """Boolean (size, size) mask sampled at pixel centres: a disc, a full square, or an upright
    isosceles triangle (apex at the top centre, base along the bottom row)."""
    c = (np.arange(size) + 0.5) / size  # pixel centres in (0, 1)
    yy, xx = np.meshgrid(c, c, indexing="ij")
    if shape == "circle":
        return (xx - 0.5) ** 2 + (yy - 0.5) ** 2 <= 0.25
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "triangle":
        return np.abs(xx - 0.5) <= yy / 2
    raise ValueError(f"unknown shape {shape!r}; shapes: {list(SHAPES)}")


def render(scene: Scene) -> np.ndarray:
    """uint8 (H, W, 3) image of the scene."""
    image = np.empty((scene.height, scene.width, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for o in scene.objects:
        window = image[o.y:o.y + o.size, o.x:o.x + o.size]
        window[shape_mask(o.shape, o.size)] = PALETTE[o.color]
    return image


def fade(image: np.ndarray, weight: float) -> np.ndarray:
    """The image blended toward the background: every pixel keeps `weight` of its difference from
    BACKGROUND. Below weight 0.5 an object's pixels lie nearer the background than their palette colour,
    so the evaluator reads a faded object as background."""
    background = np.array(BACKGROUND, dtype=np.float32)
    return np.round(background + weight * (image.astype(np.float32) - background)).astype(np.uint8)


# ----- the evaluator -------------------------------------------------------------------------

@dataclass(frozen=True)
class Detection:
    color: str
    shape: str
    area: int
    cx: float  # centroid column (pixel centres at i + 0.5)
    cy: float  # centroid row
    fill: float  # area / bounding-box area


# Index 0 is the background; 1.. follow COLORS.
_REFERENCE = np.array([BACKGROUND, *PALETTE.values()], dtype=np.float32)  # (7, 3)
_NEIGHBOURS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)]


def segment(image: np.ndarray) -> np.ndarray:
    """Per-pixel index of the nearest reference colour (0 = background, i = COLORS[i - 1]), with
    speckle removed: a pixel that shares its class with fewer than 2 of its 8 neighbours takes its
    neighbourhood's most common class. Corners and triangle apexes keep 2 or more and survive."""
    pixels = image.astype(np.float32)[..., None, :]  # (H, W, 1, 3)
    classes = ((pixels - _REFERENCE) ** 2).sum(-1).argmin(-1)  # (H, W)
    h, w = classes.shape
    padded = np.pad(classes, 1, mode="edge")
    votes = np.zeros((len(_REFERENCE), h, w), dtype=np.int8)  # class counts among the 8 neighbours
    for dy, dx in _NEIGHBOURS:
        window = padded[1 + dy:1 + dy + h, 1 + dx:1 + dx + w]
        votes += window[None] == np.arange(len(_REFERENCE))[:, None, None]
    own = np.take_along_axis(votes, classes[None], 0)[0]
    return np.where(own < 2, votes.argmax(0), classes)


def connected_components(classes: np.ndarray) -> np.ndarray:
    """8-connected components of equal non-zero class, by label propagation: every pixel takes the
    smallest label among its same-class neighbours until nothing changes. Returns labels (0 = bg)."""
    h, w = classes.shape
    big = h * w + 1
    labels = np.where(classes > 0, np.arange(1, h * w + 1).reshape(h, w), big)
    padded_cls = np.pad(classes, 1, constant_values=0)
    same = [padded_cls[1 + dy:1 + dy + h, 1 + dx:1 + dx + w] == classes for dy, dx in _NEIGHBOURS]
    for _ in range(h * w):
        padded = np.pad(labels, 1, constant_values=big)
        new = labels
        for (dy, dx), ok in zip(_NEIGHBOURS, same):
            new = np.minimum(new, np.where(ok, padded[1 + dy:1 + dy + h, 1 + dx:1 + dx + w], big))
        new = np.where(classes > 0, new, big)
        if np.array_equal(new, labels):
            break
        labels = new
    labels = np.where(classes > 0, labels, 0)
    _, dense = np.unique(labels, return_inverse=True)  # 0 stays 0 (smallest label)
    return dense.reshape(h, w)


def classify_shape(mask: np.ndarray) -> tuple[str, float]:
    """Shape of one component from its geometry: an upright triangle holds about a quarter of its
    area in the upper half of its box and fills about half of it; a disc fills pi/4 of its box, a
    square all of it. Returns (shape, fill ratio)."""
    rows, cols = np.nonzero(mask)
    top, bottom, left, right = rows.min(), rows.max(), cols.min(), cols.max()
    box_h, box_w = bottom - top + 1, right - left + 1
    fill = len(rows) / float(box_h * box_w)
    upper = (rows + 0.5 < (top + bottom + 1) / 2).sum() / len(rows)
    # Thresholds sit between the ranges measured on rendered shapes of every size, crisp and after a
    # 3x3 blur plus noise (circle fill 0.70-0.85, square 0.85-1.0, triangle upper share 0.21-0.43).
    if upper < 0.39 or fill < 0.66:
        return "triangle", fill
    return ("square" if fill > 0.87 else "circle"), fill


def detect(image: np.ndarray, min_area: int | None = None) -> list[Detection]:
    """Objects of palette colours in a uint8 (H, W, 3) image. Components smaller than `min_area`
    pixels (default H*W/128, 8 px at 32x32) are treated as noise."""
    h, w, _ = image.shape
    min_area = max(1, h * w // 128) if min_area is None else min_area
    classes = segment(image)
    labels = connected_components(classes)
    found = []
    for label in range(1, labels.max() + 1):
        mask = labels == label
        area = int(mask.sum())
        if area < min_area:
            continue
        rows, cols = np.nonzero(mask)
        shape, fill = classify_shape(mask)
        color = COLORS[int(classes[rows[0], cols[0]]) - 1]
        found.append(Detection(color, shape, area, float(cols.mean() + 0.5), float(rows.mean() + 0.5), fill))
    return found


def _in_half(d: Detection, position: str, height: int, width: int) -> bool:
    return {"left": d.cx < width / 2, "right": d.cx > width / 2,
            "top": d.cy < height / 2, "bottom": d.cy > height / 2}[position]


# Weights of the four checks; a prompt without a position phrase spreads its weight over the rest.
WEIGHTS = {"color": 0.2, "shape": 0.2, "count": 0.4, "position": 0.2}
EXTRA_PENALTY = 0.5  # the score is divided by 1 + EXTRA_PENALTY x (objects the prompt does not name)


def evaluate(image: np.ndarray, spec: Spec | str) -> tuple[float, dict[str, float | None]]:
    """GenEval-like score in [0, 1] of a uint8 (H, W, 3) image for a prompt, and its breakdown.

    With R = the number of objects the prompt asks for, and n(c, s) = detected objects of colour c
    and shape s:
      color    = sum over prompt colours c of min(n(c, any shape), objects asked in c) / R
      shape    = sum over asked groups (c, s, k) of min(n(c, s), k) / R
      count    = sum over asked groups of k/R * (1 if n(c, s) == k else 0.5 * max(0, 1 - |n - k| / k))
      position = sum over asked groups of min(objects of (c, s) in the named half, k) / R
                 (None when the prompt names no position)
      extra    = detected objects whose (colour, shape) the prompt does not name
    score = weighted mean of the checks (WEIGHTS) / (1 + EXTRA_PENALTY * extra). Exactly the asked
    objects, and nothing else, score 1.0; a wrong colour or count loses most of the credit, and
    clutter (or noise) cannot collect colour credit by offering every colour.
    """
    spec = parse_prompt(spec) if isinstance(spec, str) else spec
    h, w, _ = image.shape
    found = detect(image)
    groups: dict[tuple[str, str], int] = {}
    for o in spec.objects:
        groups[(o.color, o.shape)] = groups.get((o.color, o.shape), 0) + o.count
    per_color: dict[str, int] = {}
    for (c, _s), k in groups.items():
        per_color[c] = per_color.get(c, 0) + k
    total = float(sum(groups.values()))

    color = sum(min(sum(d.color == c for d in found), k) for c, k in per_color.items()) / total
    shape = 0.0
    count = 0.0
    position = 0.0
    for (c, s), k in groups.items():
        matches = [d for d in found if d.color == c and d.shape == s]
        n = len(matches)
        shape += min(n, k) / total
        count += k / total * (1.0 if n == k else 0.5 * max(0.0, 1.0 - abs(n - k) / k))
        if spec.position:
            position += min(sum(_in_half(d, spec.position, h, w) for d in matches), k) / total
    extra = float(sum((d.color, d.shape) not in groups for d in found))

    breakdown: dict[str, float | None] = {"color": color, "shape": shape, "count": count,
                                          "position": position if spec.position else None, "extra": extra}
    weights = {k: v for k, v in WEIGHTS.items() if breakdown[k] is not None}
    score = sum(weights[k] * breakdown[k] for k in weights) / sum(weights.values())
    return float(score / (1.0 + EXTRA_PENALTY * extra)), breakdown

def scene_pixels(images: list[np.ndarray]) -> torch.Tensor:
    """uint8 (H, W, 3) renders -> (B, 3, H, W) float in [-1, 1], the autoencoder's input."""
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1
