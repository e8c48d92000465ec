"""The peers' reward protocols as clients (rewards/remote.py, rewards/pickle_wire.py, rewards/judge.py)
and as served by scripts/reward_server.py --protocol flow_grpo, each against a real server process on
127.0.0.1: tests/peer_servers.py implements Flow-GRPO's reward server, VeRL-Omni's HTTP scorer and an
OpenAI-compatible judge as the peers' code does, and answers hostile answers at other paths."""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from lab.launch import ROOT, TINY, torchrun, trained_weights
from rewards import RewardSet
from rewards.pickle_wire import jpeg_bytes, jpeg_round_trip
from rewards.remote import RewardServiceError
from rewards.reward import to_uint8_hwc

USER = os.path.join("tests", "fixtures", "user_rewards.py")
JPEG_MEAN = f"{USER}:jpeg_mean"
IMAGES = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
PROMPTS = [f"a photo of thing {i}" for i in range(6)]
METADATA = [{"text": f"T{i}"} for i in range(6)]


class Process:
    """A server process started from the project root; `port` once it says where it listens."""

    def __init__(self, cmd: list[str], ready: str):
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        said = []
        while line := self.proc.stdout.readline():
            if found := re.search(ready, line):
                break
            said.append(line)
        else:
            raise AssertionError(f"the server did not start: {''.join(said)}")
        self.port = int(found.group(1))
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drain what it says next

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("peers")
    marker, log = str(folder / "owned"), str(folder / "judge.log")
    servers = {kind: Process([sys.executable, os.path.join("tests", "peer_servers.py"), kind, "--marker", marker,
                              "--log", log], r"listening (\d+)") for kind in ("flow_grpo", "verl_omni", "openai")}
    servers["marker"], servers["log"], servers["folder"] = marker, log, folder
    yield servers
    for kind in ("flow_grpo", "verl_omni", "openai"):
        servers[kind].stop()


def url(peers, kind: str, name: str, mode: str = "") -> str:
    base = f"http://127.0.0.1:{peers[kind].port}/" + (f"{mode}/" if mode else "") + ("v1/" if kind == "openai" else "")
    return f"{kind}+{base}{name}"


@pytest.mark.parametrize("kind", ["flow_grpo", "verl_omni"])
def test_a_peer_server_scores_what_the_local_reward_of_the_jpeg_round_trip_scores(peers, kind):
    """Scores through the peer's protocol equal, bit for bit, a user reward that scores the JPEG the
    peer's client sends; numpy arrays among the answer's values are plain data; a video goes as frames."""
    local = RewardSet([f"{JPEG_MEAN}:0.5"]).score_combined(IMAGES, PROMPTS, METADATA)
    for mode in ("", "numpy"):
        served = RewardSet([url(peers, kind, "jpeg_mean", mode) + ":0.5"]).score_combined(IMAGES, PROMPTS, METADATA)
        assert torch.equal(served["jpeg_mean"], local[JPEG_MEAN]) and torch.equal(served["combined"], local["combined"])
    video = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    frames = video.permute(0, 2, 1, 3, 4).flatten(0, 1)
    expected = RewardSet([JPEG_MEAN]).score(frames, ["v"] * 6)[JPEG_MEAN].reshape(2, 3).mean(dim=1)
    assert torch.equal(RewardSet([url(peers, kind, "jpeg_mean")]).score(video, ["v", "w"])["jpeg_mean"], expected)


HOSTILE = {  # mode: what the one error line says
    "evil": "a pickle refused: the pickle names posix.system, which may run code",
    "object": "a pickle refused: the pickle names collections.OrderedDict",
    "wrong_count": "5 scores for 6 images",
    "nan": "non-finite scores (nan at sample 0)",
    "garbage": "not a pickle",
    "error": "an error: 'CUDA out of memory'",
    "crash": "gave no scores within 3 s (--reward-timeout-s; ",
    "slow": "no complete answer within",
}


@pytest.mark.parametrize("kind", ["flow_grpo", "verl_omni"])
@pytest.mark.parametrize("mode", list(HOSTILE))
def test_a_hostile_peer_answer_stops_the_run_naming_the_url_and_runs_no_code(peers, kind, mode):
    spec = url(peers, kind, "jpeg_mean", mode)
    start = time.monotonic()
    with pytest.raises(RewardServiceError) as err:
        RewardSet([spec], timeout_s=3).score_combined(IMAGES, PROMPTS, METADATA)
    line, took = str(err.value), time.monotonic() - start
    expected = HOSTILE[mode]
    if mode == "crash":  # a 500 is retried until the deadline, quoting the peer's traceback or error
        assert re.search(r"\d+ tries, the last: HTTP 500 '(Traceback|RuntimeError: CUDA error)", str(err.value))
    assert f"reward service http://127.0.0.1:{peers[kind].port}/{mode}/ " in line and expected in line, line
    assert "\n" not in line and took < 3 + 1.5, (line, took)
    assert not os.path.exists(peers["marker"]), "the answer's pickle ran a command"


def test_a_500_is_retried_until_the_peer_answers(peers):
    got = RewardSet([url(peers, "flow_grpo", "jpeg_mean", "flaky")], timeout_s=20).score(IMAGES, PROMPTS)
    assert torch.equal(got["jpeg_mean"], RewardSet([JPEG_MEAN]).score(IMAGES, PROMPTS)[JPEG_MEAN])


def judge_file(peers, rule: str, **more) -> str:
    folder = peers["folder"]
    (folder / "question.txt").write_text("Caption: [{prompt}] target {text}. Give a 'Final Score:'.")
    fields = {"model": "judge-7b", "template": "question.txt", "concurrency": 3, **more}
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items()] + [rule]
    path = folder / f"judge-{abs(hash(tuple(lines)))}.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


REGEX = "score_regex = 'Final Score:\\s*([0-9.]+)'"


def judged(images: torch.Tensor) -> torch.Tensor:
    """What the judge answers of each image (its PNG's mean pixel, printed with 6 decimals), as float32."""
    means = [float(np.asarray(a, dtype=np.float64).mean() / 255.0) for a in to_uint8_hwc(images)]
    return torch.tensor([float(f"{m:.6f}") for m in means], dtype=torch.float64).float()


def test_an_openai_judge_scores_each_image_with_its_template_concurrently(peers):
    open(peers["log"], "w").close()
    for mode, rule in (("", REGEX), ("json", 'score_json = "score"')):
        spec = url(peers, "openai", "ur", mode) + ":2"
        rs = RewardSet([spec], judges={"ur": judge_file(peers, rule)})
        scores = rs.score_combined(IMAGES, PROMPTS, METADATA)
        assert torch.equal(scores["ur"], judged(IMAGES)) and torch.equal(scores["combined"], 2 * judged(IMAGES))
    asked = [json.loads(line) for line in open(peers["log"])]
    assert sorted(a["question"] for a in asked) == sorted(2 * [f"Caption: [{p}] target {m['text']}. Give a 'Final "
                                                              f"Score:'." for p, m in zip(PROMPTS, METADATA)])
    assert all(a["size"] == [32, 32] for a in asked)
    most = json.load(urllib.request.urlopen(f"http://127.0.0.1:{peers['openai'].port}/stats"))["most_in_flight"]
    assert 2 <= most <= 3, most  # concurrency = 3: six requests, at most three at a time
    resized = RewardSet([url(peers, "openai", "ur")], judges={"ur": judge_file(peers, REGEX, image_size=8)})
    resized.score(IMAGES[:1], PROMPTS[:1], METADATA[:1])
    assert json.loads(open(peers["log"]).read().splitlines()[-1])["size"] == [8, 8]


def test_a_judge_busy_with_429_is_tried_again(peers):
    rs = RewardSet([url(peers, "openai", "ur", "busy")], judges={"ur": judge_file(peers, REGEX)}, timeout_s=20)
    assert torch.equal(rs.score(IMAGES[:2], PROMPTS[:2], METADATA[:2])["ur"], judged(IMAGES[:2]))


JUDGE_FAILURES = {  # (mode, judge fields): the error line
    "unparsed": ("unparsed", {}, "a judgement its rule ('Final Score:\\\\s*([0-9.]+)') reads no finite score in "
                                 "(unparsed_score is unset): 'I cannot judge this image.'"),
    "garbage": ("garbage", {}, "an answer that is not a chat completion (choices[0].message.content)"),
    "wrong model": ("", {"model": "judge-70b"}, "answered HTTP 404 '{\"object\": \"error\", \"message\": \"The model "
                                                "`judge-70b` does not exist.\""),
    "slow": ("slow", {}, "no complete answer within"),
}


@pytest.mark.parametrize("case", list(JUDGE_FAILURES))
def test_a_judge_that_does_not_judge_stops_the_run_naming_the_url(peers, case):
    mode, fields, expected = JUDGE_FAILURES[case]
    rs = RewardSet([url(peers, "openai", "ur", mode)], judges={"ur": judge_file(peers, REGEX, **fields)}, timeout_s=3)
    start = time.monotonic()
    with pytest.raises(RewardServiceError) as err:
        rs.score(IMAGES[:2], PROMPTS[:2], METADATA[:2])
    line = str(err.value)
    endpoint = f"http://127.0.0.1:{peers['openai'].port}/{mode + '/' if mode else ''}v1/chat/completions"
    assert line.startswith(f"reward service {endpoint} ") and expected in line, line
    assert time.monotonic() - start < 3 + 1.5


def test_a_judge_file_may_score_what_it_cannot_read(peers):
    rs = RewardSet([url(peers, "openai", "ur", "unparsed")], judges={"ur": judge_file(peers, REGEX, unparsed_score=0.0)})
    assert rs.score(IMAGES[:2], PROMPTS[:2])["ur"].tolist() == [0.0, 0.0]  # Flow-GRPO's client: 0


@pytest.fixture(scope="module")
def ours():
    server = Process([sys.executable, "-m", "scripts.reward_server", "--port", "0", "--device", "cpu", "--reward",
                      "jpeg_compressibility", "--protocol", "flow_grpo"], r"serving flow_grpo\+http://[^:]+:(\d+)/")
    yield server
    server.stop()


def post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_our_server_speaks_flow_grpo_to_the_peers_clients_and_to_ours(ours, tmp_path):
    """A Flow-GRPO client (its deqa/unifiedreward request at POST /, reading "outputs") and VeRL-Omni's
    (reading "scores") get the registered reward of the JPEG they sent; our flow_grpo client too. A
    request that pickles code is refused (400), and nothing runs."""
    expected = RewardSet(["jpeg_compressibility"]).score(jpeg_round_trip(IMAGES), PROMPTS)["jpeg_compressibility"]
    status, data = post(ours.port, "/", pickle.dumps({"images": jpeg_bytes(IMAGES), "prompts": PROMPTS}))
    answer = pickle.loads(data)
    assert status == 200 and torch.equal(torch.tensor(answer["outputs"]).float(), expected)
    status, data = post(ours.port, "/jpeg_compressibility", pickle.dumps(
        {"images": jpeg_bytes(IMAGES), "prompts": PROMPTS, "metadata": {}}))
    assert status == 200 and torch.equal(torch.tensor(pickle.loads(data)["scores"]).float(), expected)
    served = RewardSet([f"flow_grpo+http://127.0.0.1:{ours.port}/jpeg_compressibility"]).score(IMAGES, PROMPTS)
    assert torch.equal(served["jpeg_compressibility"], expected)

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'owned'}",)

    status, data = post(ours.port, "/", pickle.dumps({"images": jpeg_bytes(IMAGES[:1]), "x": Evil()}))
    assert status == 400 and b"a pickle refused: the pickle names posix.system" in data, data
    assert not (tmp_path / "owned").exists()
    status, data = post(ours.port, "/", pickle.dumps({"images": [b"not a jpeg"]}))
    assert status == 400 and b"image 0 is not a JPEG" in data


def test_a_run_scored_by_a_flow_grpo_server_trains_the_weights_of_the_local_user_reward(peers, tmp_path):
    """A 2-step disaggregated run with --reward tests/fixtures/user_rewards.py:jpeg_mean (a user's own
    function) and one scored through Flow-GRPO's protocol by tests/peer_servers.py train the same
    weights; the rewards varied, so the runs trained."""
    args = [a for a in TINY]
    at = args.index("--reward")
    del args[at:at + 2]
    args += ["--steps", "2", "--save-every", "2"]
    local, served = tmp_path / "local", tmp_path / "served"
    torchrun(2, [*args, "--reward", JPEG_MEAN, "--output-dir", str(local)])
    torchrun(2, [*args, "--reward", url(peers, "flow_grpo", "jpeg_mean"), "--output-dir", str(served)])
    a, b = trained_weights(str(local), 2), trained_weights(str(served), 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in open(local / "metrics.jsonl") if '"reward/std"' in line]
    assert rows and all(r["reward/std"] > 0 for r in rows), rows
    assert [r["reward/mean"] for r in rows] == [json.loads(line)["reward/mean"] for line in open(served / "metrics.jsonl")
                                                if '"reward/std"' in line]
