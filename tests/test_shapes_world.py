"""The shapes world: renderer, grammar and evaluator agree; the shapes reward's contract."""
import numpy as np
import pytest
import torch

from rewards import shapes_world as sw
from rewards.shapes import ShapesReward


def _scene(prompt: str, seed: int = 0) -> np.ndarray:
    return sw.render(sw.sample_scene(np.random.default_rng(seed), sw.parse_prompt(prompt)))


def test_rendered_scenes_score_one_for_their_own_prompt():
    rng = np.random.default_rng(0)
    for _ in range(300):
        scene = sw.sample_scene(rng)
        prompt = sw.scene_to_prompt(scene)
        score, breakdown = sw.evaluate(sw.render(scene), prompt)
        assert score == 1.0, (prompt, breakdown, scene)


@pytest.mark.parametrize("kind", sw.KINDS)
@pytest.mark.parametrize("position", [None, *sw.POSITIONS])
def test_every_template_and_position_scores_one(kind, position):
    specs = [s for s in sw.all_specs() if s.kind == kind and s.position == position]
    rng = np.random.default_rng(1)
    for i in rng.choice(len(specs), size=6, replace=False):
        prompt = sw.spec_to_prompt(specs[i])
        assert sw.parse_prompt(prompt) == specs[i]
        scene = sw.sample_scene(rng, specs[i])
        assert sw.scene_to_prompt(scene) == prompt
        assert sw.evaluate(sw.render(scene), prompt)[0] == 1.0, prompt


def test_render_format():
    image = _scene("three cyan triangles on the bottom")
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert tuple(image[0, 0]) == sw.BACKGROUND
    assert set(map(tuple, image.reshape(-1, 3))) <= {sw.BACKGROUND, sw.PALETTE["cyan"]}
    assert np.all(image[:16] == sw.BACKGROUND)  # everything lies in the bottom half


@pytest.mark.parametrize("drawn, asked", [
    ("a red circle", "a blue circle"),
    ("two green squares", "two yellow squares"),
    ("a red circle and a blue square", "a red circle and a cyan square"),
    ("two red circles", "three red circles"),
    ("two red circles", "a red circle"),
    ("three magenta triangles", "two magenta triangles"),
    ("a yellow square", "two yellow squares"),
])
def test_wrong_color_or_count_scores_clearly_lower(drawn, asked):
    for seed in range(5):
        score, breakdown = sw.evaluate(_scene(drawn, seed), asked)
        assert score < 0.7, (drawn, asked, score, breakdown)


def test_breakdown_isolates_the_failed_check():
    image = _scene("two red circles on the left")
    _, right = sw.evaluate(image, "two red circles on the right")
    assert right["color"] == right["shape"] == right["count"] == 1.0 and right["position"] == 0.0
    _, square = sw.evaluate(image, "two red squares")
    assert square["color"] == 1.0 and square["shape"] == 0.0 and square["position"] is None
    assert square["extra"] == 2  # the two red circles are objects the prompt does not name


def test_extra_objects_and_noise_score_low():
    score, breakdown = sw.evaluate(_scene("a red circle and a blue square"), "a red circle")
    assert breakdown["color"] == breakdown["shape"] == breakdown["count"] == 1.0 and breakdown["extra"] == 1
    assert score < 0.7
    rng = np.random.default_rng(0)
    noise = [sw.evaluate(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), p)[0]
             for p in ("a red circle", "a blue square and a green triangle", "three cyan circles on the top")]
    assert max(noise) < 0.3, noise


def test_faded_objects_read_as_background_below_half_weight():
    rng = np.random.default_rng(2)
    for _ in range(100):
        scene = sw.sample_scene(rng)
        image, prompt = sw.render(scene), sw.scene_to_prompt(scene)
        assert np.array_equal(sw.fade(image, 1.0), image)
        assert sw.evaluate(sw.fade(image, 0.7), prompt)[0] == 1.0, prompt  # fainter, still its colours
        score, breakdown = sw.evaluate(sw.fade(image, 0.45), prompt)
        assert score == 0.0 and breakdown["extra"] == 0, (prompt, breakdown)  # nothing seen at all


@pytest.mark.parametrize("prompt", ["a purple circle", "two red circle", "a red circles", "a red hexagon",
                                    "a red circle on the middle", "four red circles", "", "a red circle and"])
def test_parse_prompt_rejects_non_grammar_prompts(prompt):
    with pytest.raises(ValueError, match="not in the shapes-world grammar"):
        sw.parse_prompt(prompt)


def test_parse_prompt_normalises_case_and_spaces():
    assert sw.parse_prompt("  Two  Red circles on the LEFT ") == sw.Spec((sw.ObjectSpec("red", "circle", 2),), "left")


def test_grammar_size():
    prompts = [sw.spec_to_prompt(s) for s in sw.all_specs()]
    assert len(prompts) == len(set(prompts)) == 5 * (54 + 18 * 17)


def test_shapes_reward_shape_and_range():
    prompts = ["a red circle", "two blue squares on the left", "a green triangle and a yellow circle", "a red circle"]
    images = np.stack([_scene(p, i) for i, p in enumerate(prompts[:3])] + [_scene("a blue square")])
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255  # (B, 3, H, W)
    scores = ShapesReward()(x, prompts, [{}] * 4)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert torch.all((scores >= 0) & (scores <= 1))
    assert torch.allclose(scores[:3], torch.ones(3)) and scores[3] < 0.7
    noise = ShapesReward()(torch.rand(4, 3, 32, 32), prompts, None)
    assert noise.shape == (4,) and torch.all((noise >= 0) & (noise <= 1))
    # Another resolution is resized to the world's; a video is scored as the mean over frames.
    big = torch.nn.functional.interpolate(x, scale_factor=2, mode="nearest")
    assert torch.allclose(ShapesReward()(big, prompts, None), scores)
    video = torch.stack([x, x], dim=2)  # (B, 3, F, H, W)
    assert torch.allclose(ShapesReward()(video, prompts, None), scores)
    with pytest.raises(ValueError, match="not in the shapes-world grammar"):
        ShapesReward()(x[:1], ["a photo of a cat"], None)
