"""A user's own reward (rewards/user.py), reward specs and scales (rewards/__init__.py), the judge
file and its score rules (rewards/judge.py), and the restricted unpickler (rewards/pickle_wire.py).
No process starts here: the servers are in tests/test_peer_protocols.py."""
from __future__ import annotations

import os
import pickle
import re

import numpy as np
import pytest
import torch

from rewards import (RewardSet, check_reward_options, check_user_rewards, parse_reward_spec, parse_reward_specs,
                     prompt_checker, reward_scales, user_target)
from rewards import judge, pickle_wire, user
from rewards.shapes import ShapesReward

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.relpath(os.path.join(HERE, "fixtures", "user_rewards.py"), os.getcwd())


def spec(name: str) -> str:
    return f"{FIXTURE}:{name}"


def test_specs_tell_a_weight_after_the_last_colon_from_a_function():
    assert parse_reward_spec("mymod.sub:score") == ("mymod.sub:score", 1.0)
    assert parse_reward_spec("mymod.sub:score:0.5") == ("mymod.sub:score", 0.5)
    assert parse_reward_spec("path/to/r.py:score:-2") == ("path/to/r.py:score", -2.0)
    assert parse_reward_spec("shapes:0.5") == ("shapes", 0.5)
    assert user_target("mymod:score:0.5") == "mymod:score" and user_target("shapes:0.5") is None
    assert user_target("flow_grpo+http://h:1/geneval") is None
    with pytest.raises(ValueError, match="weight 'abc' is not a number"):  # a registered name, a bad weight
        parse_reward_spec("shapes:abc")
    with pytest.raises(ValueError, match="module.path:function or path/to/file.py:function"):
        parse_reward_spec("my-mod:score")
    with pytest.raises(ValueError, match="weight inf must be a finite number"):
        parse_reward_spec("mymod:score:inf")
    with pytest.raises(ValueError, match="given more than once"):
        parse_reward_specs(["mymod:score", "mymod:score:2"])
    assert prompt_checker("shapes") is ShapesReward and prompt_checker("http://h:1/shapes") is ShapesReward
    assert prompt_checker("mymod:score") is None and prompt_checker("http://h:1/my_judge") is None


def test_a_function_a_file_and_a_class_score_as_any_reward(monkeypatch, tmp_path):
    (tmp_path / "my_scores.py").write_text("import torch\n\ndef red(images, prompts, metadata):\n"
                                           "    return images[:, 0].mean(dim=(1, 2)).double()\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # a module on PYTHONPATH, as a user's would be
    images = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts, metadata = ["a", "bb", "ccc"], [{}, {"bonus": 10}, {}]
    rs = RewardSet(["my_scores:red:2", spec("prompt_length"), spec("Brightness")])
    scores = rs.score_combined(images, prompts, metadata)
    assert scores["my_scores:red"].dtype == torch.float32
    assert torch.equal(scores["my_scores:red"], images[:, 0].mean(dim=(1, 2)).double().float())
    assert scores[spec("prompt_length")].tolist() == [1.0, 12.0, 3.0]
    assert torch.equal(scores[spec("Brightness")], images.flatten(1).mean(dim=1))
    assert torch.equal(scores["combined"], 2 * scores["my_scores:red"] + scores[spec("prompt_length")]
                       + scores[spec("Brightness")])
    video = torch.rand(2, 3, 4, 8, 8)  # a video goes to the function whole
    assert torch.equal(RewardSet([spec("Brightness")]).score(video, ["a", "b"])[spec("Brightness")],
                       video.flatten(1).mean(dim=1))
    assert user.load(spec("Brightness")) is user.load(spec("Brightness"))  # one object per process


CHECKS = {  # spec: what the start-up check says
    "nomod_xyz:score": "cannot import 'nomod_xyz' (is its folder on PYTHONPATH? or give the file",
    "no/such/file.py:score": "no such file 'no/such/file.py'",
    spec("missing"): "has no attribute 'missing'",
    spec("NOT_CALLABLE"): "'NOT_CALLABLE' is a int, not a function or a class with __call__",
    spec("wrong_count"): "returned (3,) scores for 2 images; a reward returns one score per image, shape (2,)",
    spec("nan_scores"): "returned non-finite scores on a dummy batch (nan at sample 1)",
    spec("raises"): "failed on a dummy batch (2, 3, 64, 64): RuntimeError: the scorer's model is not loaded",
    spec("text"): "returned a str, not B numbers",
}


@pytest.mark.parametrize("bad", list(CHECKS))
def test_a_bad_user_reward_is_a_value_error_naming_the_spec_at_start_up(bad):
    with pytest.raises(ValueError) as err:
        check_user_rewards(["shapes", f"{bad}:0.5"])
    assert str(err.value).startswith(f"--reward {bad}: ") and CHECKS[bad] in str(err.value), str(err.value)


def test_a_user_reward_is_checked_on_video_for_a_video_model():
    check_user_rewards([spec("Brightness")], video=True)
    assert user.dummy_batch(True)[0].shape == (2, 3, 3, 64, 64)


def test_scales_multiply_a_rewards_scores_before_they_are_logged_and_combined():
    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    plain = RewardSet(["jpeg_compressibility:0.5"]).score_combined(images, ["x"] * 4)
    scaled = RewardSet(["jpeg_compressibility:0.5", "shapes"], scales={"jpeg_compressibility": 0.002}
                       ).score_combined(images, ["a red square"] * 4)
    flow_grpo = plain["jpeg_compressibility"] * 0.002  # Flow-GRPO's -kB/500
    assert torch.equal(scaled["jpeg_compressibility"], flow_grpo)
    assert torch.equal(scaled["combined"], 0.5 * flow_grpo + scaled["shapes"])
    assert reward_scales(["jpeg_compressibility=0.002", "pickscore=0.0385"]) == {"jpeg_compressibility": 0.002,
                                                                                 "pickscore": 0.0385}
    for bad in ("jpeg_compressibility", "x=0", "x=nan", "=2"):
        with pytest.raises(ValueError, match=re.escape(f"bad --reward-scale {bad!r}")):
            reward_scales([bad])
    with pytest.raises(ValueError, match=r"--reward-scale names \['ocr'\], which the run does not score"):
        check_reward_options(["shapes"], {}, {"ocr": 2.0})


JUDGE = """model = "judge-7b"
template = "question.txt"
score_regex = 'Final Score:\\s*([0-9.]+)'
"""


def write_judge(tmp_path, text: str = JUDGE, template: str = "Rate [{prompt}] against {text}; keep {braces}."):
    (tmp_path / "question.txt").write_text(template)
    path = tmp_path / "judge.toml"
    path.write_text(text)
    return str(path)


def test_a_judge_file_fills_its_template_and_reads_scores_by_its_rule(tmp_path):
    j = judge.JudgeConfig.read("ur", write_judge(tmp_path))
    assert judge.question(j.text, "a cat", {"text": "OPEN"}) == "Rate [a cat] against OPEN; keep {braces}."
    assert judge.parse_score(j, "ok.\nFinal Score: 4.5\nFinal Score: 1") == 4.5
    assert judge.parse_score(j, "no score here") is None
    j.matches = "mean"
    assert judge.parse_score(j, "Final Score: 4.5 ... Final Score: 1.5") == 3.0
    j = judge.JudgeConfig.read("ur", write_judge(tmp_path, 'model = "m"\ntemplate = "question.txt"\n'
                                                          'score_json = "result.score"\n'))
    assert judge.parse_score(j, 'Sure!\n```json\n{"result": {"score": "7.5"}}\n```') == 7.5
    assert judge.parse_score(j, '{"result": {"score": NaN}}') is None
    assert judge.parse_score(j, '{"result": {"score": true}}') is None
    assert judge.parse_score(j, "not json {") is None


JUDGE_ERRORS = {
    'model = "m"\ntemplate = "question.txt"\n': "give one rule: score_regex or score_json",
    'template = "question.txt"\nscore_json = "s"\n': "'model' must be given",
    'model = "m"\ntemplate = "none.txt"\nscore_json = "s"\n': "cannot read the template",
    'model = "m"\ntemplate = "question.txt"\nscore_regex = "(["\n': "is not a regex",
    'model = "m"\ntemplate = "question.txt"\nscore_json = "s"\nconcurrency = 0\n': "concurrency 0 must be an integer >= 1",
    'model = "m"\ntemplate = "question.txt"\nscore_json = "s"\nseed = 1\n': "unknown field(s) ['seed']",
    'model = "m"\ntemplate = "question.txt"\nscore_json = "s"\nimage_format = "gif"\n': "image_format 'gif'",
    'model = "m\n': "cannot read the judge file",
}


@pytest.mark.parametrize("text", list(JUDGE_ERRORS))
def test_a_bad_judge_file_is_a_value_error_naming_the_flag(tmp_path, text):
    path = write_judge(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(JUDGE_ERRORS[text])) as err:
        check_reward_options(["ur"], {"ur": path}, {}, ["openai+http://h:1/v1/ur"])
    assert str(err.value).startswith(f"--reward-judge ur={path}: ")


def test_a_judge_needs_an_openai_url_and_an_openai_url_a_judge(tmp_path):
    path = write_judge(tmp_path)
    check_reward_options(["ur"], {"ur": path}, {}, ["openai+http://h:1/v1/ur"])
    with pytest.raises(ValueError, match=r"needs --reward-judge ur=FILE"):
        check_reward_options(["ur"], {}, {}, ["openai+http://h:1/v1/ur"])
    with pytest.raises(ValueError, match=r"is not an openai\+http:// judge"):
        check_reward_options(["ur"], {"ur": path}, {}, ["flow_grpo+http://h:1/ur"])


class Sneaky:
    def __reduce__(self):
        return os.system, ("echo owned",)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_the_unpickler_admits_plain_data_and_numpy_arrays_only(protocol):
    plain = {"scores": [0.5, 1, True, None], "t": (1.5, "s", b"b"), "set": {1, 2}, "n": np.float32(0.25),
             "a": np.arange(4, dtype=np.float64), "f": frozenset({3})}
    got = pickle_wire.safe_loads(pickle.dumps(plain, protocol=protocol))
    assert got["scores"] == plain["scores"] and got["t"] == plain["t"] and got["set"] == {1, 2}
    assert got["n"] == np.float32(0.25) and np.array_equal(got["a"], plain["a"]) and got["f"] == frozenset({3})
    for hostile, named in ((Sneaky(), "names posix.system"), (re.compile("x"), "names re._compile"),
                           (np.array([Sneaky()], dtype=object), "names posix.system")):
        with pytest.raises(ValueError, match=re.escape(named)):
            pickle_wire.safe_loads(pickle.dumps({"scores": [1.0], "x": hostile}, protocol=protocol))
    with pytest.raises(ValueError, match="not a pickle"):
        pickle_wire.safe_loads(b"<html>502</html>")


def test_a_crafted_numpy_rebuild_is_refused():
    # numpy's _reconstruct asked for a huge array: only the empty array numpy's own pickles start from passes
    crafted = (b"\x80\x04cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
               b"(J\x00\x00\x00\x40tC\x01b\x87R.")
    with pytest.raises(ValueError, match="_reconstruct of anything but an empty ndarray"):
        pickle_wire.safe_loads(crafted)


def test_peer_answers_become_float32_scores_or_name_what_is_wrong():
    assert torch.equal(pickle_wire.decode_answer(pickle.dumps({"scores": [0.1, 2]}), 2),
                       torch.tensor([0.1, 2.0], dtype=torch.float64).float())
    assert pickle_wire.decode_answer(pickle.dumps({"outputs": np.array([3.0])}), 1).tolist() == [3.0]
    for answer, said in (({"scores": [1.0]}, "1 scores for 2 images"), ({"error": "OOM"}, "an error: 'OOM'"),
                         ({"x": 1}, "without 'scores' or 'outputs'"), ([1.0, 2.0], "a pickled list"),
                         ({"scores": ["a", "b"]}, "'scores' that are not numbers")):
        with pytest.raises(ValueError, match=re.escape(said)):
            pickle_wire.decode_answer(pickle.dumps(answer), 2)


def test_the_server_side_reads_a_peer_request_and_refuses_a_bomb():
    images = torch.rand(2, 3, 16, 24)
    body = pickle_wire.encode_request("flow_grpo", images, ["a", "b"], [{"tag": "x"}, {}])
    got, prompts, metadata = pickle_wire.decode_request(body)
    assert got.shape == (2, 3, 16, 24) and prompts == ["a", "b"]
    assert metadata == [{"tag": "x", "prompt": "a"}, {"prompt": "b"}]
    assert torch.equal(got, pickle_wire.jpeg_round_trip(images))
    verl = pickle_wire.encode_request("verl_omni", images, ["a", "b"], [{}, {}])
    assert pickle_wire.decode_request(verl)[1:] == (["a", "b"], [{}, {}])
    big = pickle_wire.jpeg_bytes(torch.zeros(1, 3, 8, 200))
    with pytest.raises(ValueError, match="image 0 is 200 x 8; this service takes at most 100"):
        pickle_wire.decode_images(big, max_side=100)
    with pytest.raises(ValueError, match="image 0 is not a JPEG"):
        pickle_wire.decode_images([b"\x89PNG\r\n"])
