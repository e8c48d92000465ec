"""The independent scorer: GenEval's strict rule on count maps, the ground truth of rendered scenes,
the shipped detector on renders of the held-out prompts it never saw, and --eval-scorer's config."""
import numpy as np
import pytest
import torch

from config.schema import RunConfig, eval_scorers
from config.validate import check_scorers
from rewards import RewardSet, shapes_world
from rewards.shapes_detector import CLASSES, ShapesDetector, correct, quadrant_counts
from lab.train_shapes_detector import render_faded

RED_CIRCLE, BLUE_SQUARE = CLASSES.index(("red", "circle")), CLASSES.index(("blue", "square"))


def _scene(*objects):
    return shapes_world.Scene(tuple(shapes_world.SceneObject(*o) for o in objects))


def test_quadrant_counts_follow_the_mask_centroid():
    # circle box 2..11 (centre 7): top left; square box 18..27: bottom right; a triangle whose box
    # spans the middle row has its centroid below it (a triangle's area sits low in its box)
    counts = quadrant_counts(_scene(("red", "circle", 2, 2, 10), ("blue", "square", 18, 18, 10),
                                    ("green", "triangle", 2, 10, 11)))
    assert counts[RED_CIRCLE].tolist() == [1, 0, 0, 0] and counts[BLUE_SQUARE].tolist() == [0, 0, 0, 1]
    assert counts[CLASSES.index(("green", "triangle"))].tolist() == [0, 0, 1, 0]
    assert counts.sum() == 3


def test_the_strict_rule():
    counts = torch.zeros(len(CLASSES), 4, dtype=torch.long)
    counts[RED_CIRCLE, 0] = 2  # two red circles, top left
    spec = shapes_world.parse_prompt
    assert correct(counts, spec("two red circles"))
    assert correct(counts, spec("two red circles on the left")) and correct(counts, spec("two red circles on the top"))
    assert not correct(counts, spec("two red circles on the right"))
    assert not correct(counts, spec("a red circle")) and not correct(counts, spec("three red circles"))
    counts[RED_CIRCLE, 1] = 1  # a third one, top right: three, but not all on the left
    assert correct(counts, spec("three red circles on the top"))
    assert not correct(counts, spec("three red circles on the left"))
    counts[RED_CIRCLE, 1] = 0
    counts[BLUE_SQUARE, 3] = 1  # an object the prompt does not name
    assert not correct(counts, spec("two red circles"))
    counts[RED_CIRCLE, 0] = 1
    assert correct(counts, spec("a red circle and a blue square"))
    assert not correct(counts, spec("a red circle and a blue square on the left"))


@pytest.fixture(scope="module")
def detector():
    return ShapesDetector()


def _prompts(n=64):
    with open("data/shapes_eval.txt") as f:
        return [line.strip() for line in f if line.strip()][:n]


def _images(arrays):
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


def test_the_shipped_detector_on_renders_of_the_held_out_prompts(detector):
    """Scenes it never saw (another seed than its data), of the 64 evaluation prompts: drawn right, they
    are correct; faded below half their colour (absent, as the world defines it), none is."""
    rng = np.random.default_rng(123)
    prompts = _prompts()
    scenes = [shapes_world.sample_scene(rng, shapes_world.parse_prompt(p)) for p in prompts]
    crisp = detector(_images([shapes_world.render(s) for s in scenes]), prompts)
    faded = detector(_images([shapes_world.fade(shapes_world.render(s), 0.35) for s in scenes]), prompts)
    assert crisp.mean() >= 0.95, crisp.mean()
    assert faded.sum() == 0
    # one object of each scene faded away: the count (or the object) is wrong, so no image is correct
    partial = detector(_images([render_faded(s, [0.3] + [1.0] * (len(s.objects) - 1)) for s in scenes]), prompts)
    assert partial.mean() <= 0.05, partial.mean()
    # the scorer sizes images as the shapes reward does: a 64x64 upscale scores alike
    big = torch.nn.functional.interpolate(_images([shapes_world.render(s) for s in scenes]), scale_factor=2,
                                          mode="nearest")
    assert (detector(big, prompts) == crisp).float().mean() >= 0.95


def test_scorer_is_a_reward_of_the_registry_and_refuses_other_prompts(detector):
    scored = RewardSet(["shapes_detector"]).score(torch.full((2, 3, 32, 32), 0.5), ["a red circle"] * 2)
    assert scored["shapes_detector"].tolist() == [0.0, 0.0]  # an empty gray image holds no red circle
    with pytest.raises(ValueError, match="not in the shapes-world grammar"):
        ShapesDetector.check_prompt("a photo of a cat")


def test_eval_scorer_defaults_and_refusals():
    cfg = RunConfig()
    cfg.resolve_defaults()
    assert cfg.output.eval_scorer == ["shapes_detector"] and eval_scorers(cfg.output.eval_scorer) == ["shapes_detector"]
    other = RunConfig()
    other.rl.reward = ["jpeg_compressibility"]
    other.resolve_defaults()
    assert eval_scorers(other.output.eval_scorer) == []
    none = RunConfig()
    none.output.eval_scorer = ["none"]
    none.resolve_defaults()
    assert eval_scorers(none.output.eval_scorer) == []
    check_scorers(["shapes_detector"], ["shapes"], {})
    with pytest.raises(ValueError, match="trains on 'shapes'"):
        check_scorers(["shapes"], ["shapes"], {})
    with pytest.raises(ValueError, match="no weight"):
        check_scorers(["shapes_detector:2"], ["shapes"], {})
    with pytest.raises(ValueError, match="cannot go with others"):
        check_scorers(["none", "shapes_detector"], ["shapes"], {})
    with pytest.raises(ValueError, match="unknown reward 'geneval'"):
        check_scorers(["geneval"], ["shapes"], {})
    with pytest.raises(ValueError, match="pickscore=DIR"):
        check_scorers(["pickscore"], ["shapes"], {})
