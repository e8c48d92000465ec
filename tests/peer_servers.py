"""Stand-ins for the peers' reward servers, each a real process on 127.0.0.1, written from their code:

    python tests/peer_servers.py flow_grpo   yifan123/reward-server app_geneval.py: POST /, a pickled
                                             {"images": [JPEG bytes], "meta_datas", "only_strict"}, answered
                                             with pickled scores, rewards, strict_rewards, group_rewards,
                                             group_strict_rewards; 500 with the traceback on any error
    python tests/peer_servers.py verl_omni   VeRL-Omni's HTTP scorer (docs/start/http_scorer.md): a pickled
                                             {"images", "prompts", "metadata"} -> {"scores"}, or {"error"}
    python tests/peer_servers.py openai      an OpenAI-compatible /v1/chat/completions serving the judge
                                             "judge-7b", answering canned judge text

Each prints `listening PORT` once it serves. An image's score is the mean of its decoded pixels in
[0, 1] (tests/fixtures/user_rewards.py computes the same of the JPEG round trip). The first path
segment picks a behaviour, since the peers' clients post to the server's root: `/` answers as the
peer does; `/evil/` answers a pickle that would run `touch MARKER` (--marker); `/object/` a pickle
holding a class; `/wrong_count/`, `/nan/`, `/garbage/`, `/crash/` (always 500), `/flaky/` (500 the
first time), `/slow/` (30 s), `/numpy/` (scores as a numpy float32 array), `/error/` (200 with an
"error"). The judge: `/` ("... Final Score: X"), `/json/` (a ```json fence), `/unparsed/`,
`/garbage/`, `/slow/`, `/busy/` (429 the first time); every question it is sent is appended to
--log, and GET /stats says the most requests it held at once.
"""
import argparse
import base64
import collections
import io
import json
import os
import pickle
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image


def mean_pixel(image: Image.Image) -> float:
    return float(np.asarray(image.convert("RGB"), dtype=np.float64).mean() / 255.0)


class Evil:
    """Unpickling this runs a shell command: what a reward server must never get to do to a trainer."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class PickleServer(BaseHTTPRequestHandler):
    kind, marker, seen = "flow_grpo", "", collections.Counter()

    def do_POST(self):  # noqa: N802
        data = self.rfile.read(int(self.headers["Content-Length"]))
        mode = self.path.strip("/").split("/")[0] or "ok"
        self.seen[mode] += 1
        try:
            request = pickle.loads(data)  # the peers' servers trust their clients (ours must not)
            images = [Image.open(io.BytesIO(d), formats=["jpeg"]) for d in request["images"]]
            if self.kind == "flow_grpo":
                metadata, only_strict = request["meta_datas"], request["only_strict"]
                assert len(metadata) == len(images) and all("prompt" in m for m in metadata) and only_strict
            else:
                assert len(request["prompts"]) == len(images) and request["metadata"] == {}
            scores = [mean_pixel(image) for image in images]
            if mode == "crash" or (mode == "flaky" and self.seen[mode] == 1):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if mode == "slow":
                time.sleep(30)
            answer = self.answer(mode, scores)
            status = 200
        except Exception:  # noqa: BLE001 - as app_geneval.py: the traceback, with a 500
            answer, status = traceback.format_exc().encode(), 500
            if self.kind == "verl_omni":
                answer = pickle.dumps({"error": traceback.format_exc(limit=1)})
        self.send_response(status)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def answer(self, mode: str, scores: list) -> bytes:
        if mode == "evil":
            return pickle.dumps({"scores": scores, "note": Evil(self.marker)})
        if mode == "object":
            return pickle.dumps({"scores": scores, "detail": collections.OrderedDict(a=1)})
        if mode == "garbage":
            return b"<html>502 Bad Gateway</html>"
        if mode == "error":
            return pickle.dumps({"error": "CUDA out of memory"})
        if mode == "wrong_count":
            scores = scores[:-1]
        if mode == "nan":
            scores = [float("nan")] + scores[1:]
        if mode == "numpy":
            return pickle.dumps({"scores": np.array(scores, dtype=np.float32)})
        if self.kind == "verl_omni":
            return pickle.dumps({"scores": scores})
        strict = [float(s > 0.5) for s in scores]
        return pickle.dumps({"scores": scores, "rewards": strict, "strict_rewards": strict,
                             "group_rewards": {"counting": [-10.0] * len(scores)},
                             "group_strict_rewards": {"counting": [-10.0] * len(scores)}})

    def log_message(self, *args):
        pass


class JudgeServer(BaseHTTPRequestHandler):
    log, seen, lock, in_flight, most = "", collections.Counter(), threading.Lock(), [0], [0]

    def do_GET(self):  # noqa: N802
        self.reply(200, json.dumps({"most_in_flight": self.most[0]}).encode())

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.path.strip("/").split("/")[0]
        mode = "ok" if mode == "v1" else mode
        with self.lock:
            self.seen[mode] += 1
            self.in_flight[0] += 1
            self.most[0] = max(self.most[0], self.in_flight[0])
        try:
            self.judge(mode, body)
        finally:
            with self.lock:
                self.in_flight[0] -= 1

    def judge(self, mode: str, body: dict) -> None:
        if body.get("model") != "judge-7b":  # as vLLM answers a model it does not serve
            return self.reply(404, json.dumps({"object": "error", "message": f"The model `{body.get('model')}` does "
                                               f"not exist.", "type": "NotFoundError", "code": 404}).encode())
        if mode == "busy":
            if self.seen[mode] == 1:
                return self.reply(429, b'{"message": "too many requests"}')
            mode = "ok"
        content = body["messages"][0]["content"]
        url = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
        question = next(c["text"] for c in content if c["type"] == "text")
        image = Image.open(io.BytesIO(base64.b64decode(url.split("base64,", 1)[1])))
        with open(self.log, "a") as f:
            f.write(json.dumps({"question": question, "size": image.size, "mode": mode}) + "\n")
        score = mean_pixel(image)
        time.sleep(0.2)  # a judge takes its time: requests overlap
        text = {"ok": f"The image is fine.\nFinal Score: {score:.6f}",
                "json": f'Here is my verdict:\n```json\n{{"score": {score:.6f}, "reason": "ok"}}\n```',
                "unparsed": "I cannot judge this image.",
                "garbage": None}.get(mode, "")
        if mode == "slow":
            time.sleep(30)
        if text is None:
            return self.reply(200, b"<html>oops</html>")
        answer = {"id": "x", "object": "chat.completion", "model": "judge-7b",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
        self.reply(200, json.dumps(answer).encode())

    def reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("flow_grpo", "verl_omni", "openai"))
    p.add_argument("--marker", default="/nonexistent/marker")
    p.add_argument("--log", default=os.devnull)
    args = p.parse_args()
    if args.kind == "openai":
        handler = type("Judge", (JudgeServer,), {"log": args.log})
    else:
        handler = type("Peer", (PickleServer,), {"kind": args.kind, "marker": args.marker})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
