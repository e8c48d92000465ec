"""A VLM judge behind an OpenAI-compatible `/v1/chat/completions`, as vLLM or sglang serve one
(UnifiedReward in Flow-GRPO and DiffusionNFT, Qwen-VL reading text in VeRL-Omni).

    --reward openai+http://HOST:PORT/v1/NAME[:WEIGHT] --reward-judge NAME=judge.toml

Each image is one request, `concurrency` at a time: a user message holding the image (a data URL)
and the text of the judge's template, whose `{prompt}` is the sample's prompt and `{FIELD}` a field
of its metadata (any other braces stay as written). The judge's answer text becomes a score by one
documented rule (`JudgeConfig`): the number a regex captures, or a field of the JSON it writes.
An answer the rule cannot read stops the run naming the URL and the text, unless the judge file
gives `unparsed_score` (Flow-GRPO's client scores such an answer 0). The judge file (TOML):

    model = "UnifiedReward-7b-v1.5"        # the name the server serves the model under
    template = "unifiedreward.txt"         # beside this file; {prompt} is replaced
    score_regex = 'Final Score:\\s*([0-9.]+)'
    # or: score_json = "score"             # the answer is JSON (``` fences allowed); a dotted field
    image_size = 512                       # Flow-GRPO resizes to 512 x 512 (0: as generated)
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Sequence

from PIL import Image
from torch import Tensor

from rewards.reward import to_pil

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PLACEHOLDER = re.compile(r"\{(\w+)\}")
IMAGE_FORMATS = ("png", "jpeg")


@dataclass
class JudgeConfig:
    """One judge file (`--reward-judge NAME=FILE`)."""

    model: str
    """the served model's name, sent as "model" (vLLM: --served-model-name)"""
    template: str
    """the text sent with each image: a file beside the judge file (or an absolute path); `{prompt}`
    is the sample's prompt, `{FIELD}` a field of its metadata"""
    score_regex: str | None = None
    """the score is the number the regex's first group captures (the whole match without a group)"""
    score_json: str | None = None
    """or: the answer is a JSON object (a ```json fence and text around it are allowed) and the score
    is this field, dotted for nesting ("scores.overall")"""
    matches: str = "first"
    """with score_regex: first (the first match, as Flow-GRPO's re.search) or mean (of every match, as
    VeRL-Omni averages UnifiedReward 2.0's three axes)"""
    unparsed_score: float | None = None
    """the score of an answer the rule cannot read; unset: such an answer stops the run"""
    concurrency: int = 8
    """requests in flight at once per reward (a batch's images)"""
    max_tokens: int = 512
    temperature: float = 0.0
    image_format: str = "png"
    """how each image travels: png (lossless, Flow-GRPO's) or jpeg"""
    image_size: int = 0
    """resize each image to this square side first (Flow-GRPO: 512); 0 sends it as generated"""
    request: dict = field(default_factory=dict)
    """more fields of each request's JSON body (top_p, seed, ...)"""
    text: str = ""
    """the template's text, read from `template`"""

    @classmethod
    def read(cls, name: str, path: str) -> "JudgeConfig":
        """Read and check a judge file; a ValueError names the flag, the file and the bad value."""
        where = f"--reward-judge {name}={path}"
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"{where}: cannot read the judge file ({type(e).__name__}: {e})") from None
        known = {f.name for f in dataclasses.fields(cls)} - {"text"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; a judge file has {sorted(known)}")
        for required in ("model", "template"):
            if not isinstance(data.get(required), str) or not data[required]:
                raise ValueError(f"{where}: {required!r} must be given, as text")
        try:
            judge = cls(**data)
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None
        template = os.path.join(os.path.dirname(os.path.abspath(path)), judge.template)
        try:
            with open(template, encoding="utf-8") as f:
                judge.text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: cannot read the template {template!r} ({e})") from None
        judge.check(where)
        return judge

    def check(self, where: str) -> None:
        if (self.score_regex is None) == (self.score_json is None):
            raise ValueError(f"{where}: give one rule: score_regex or score_json")
        if self.score_regex is not None:
            try:
                re.compile(self.score_regex)
            except re.error as e:
                raise ValueError(f"{where}: score_regex {self.score_regex!r} is not a regex ({e})") from None
        if self.matches not in ("first", "mean"):
            raise ValueError(f"{where}: matches {self.matches!r} must be first or mean")
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(f"{where}: image_format {self.image_format!r} must be one of {IMAGE_FORMATS}")
        for what, value, low in (("concurrency", self.concurrency, 1), ("max_tokens", self.max_tokens, 1),
                                 ("image_size", self.image_size, 0)):
            if type(value) is not int or value < low:
                raise ValueError(f"{where}: {what} {value!r} must be an integer >= {low}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 2:
            raise ValueError(f"{where}: temperature {self.temperature!r} must be in [0, 2]")
        if self.unparsed_score is not None and not (isinstance(self.unparsed_score, (int, float))
                                                    and math.isfinite(self.unparsed_score)):
            raise ValueError(f"{where}: unparsed_score {self.unparsed_score!r} must be a finite number")
        if not isinstance(self.request, dict):
            raise ValueError(f"{where}: request must be a table of more request fields")


def question(template: str, prompt: str, metadata: dict) -> str:
    """The template with {prompt} and {FIELD} (a metadata field) filled in; other braces stay."""
    values = {**{k: str(v) for k, v in metadata.items()}, "prompt": prompt}
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def image_url(image: Image.Image, judge: JudgeConfig) -> str:
    if judge.image_size:
        image = image.resize((judge.image_size, judge.image_size))
    buffer = io.BytesIO()
    image.save(buffer, format=judge.image_format.upper())
    return f"data:image/{judge.image_format};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def encode_requests(judge: JudgeConfig, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> list[bytes]:
    """One chat completion request per image (N, 3, H, W)."""
    bodies = []
    for image, prompt, meta in zip(to_pil(images), prompts, metadata):
        content = [{"type": "image_url", "image_url": {"url": image_url(image, judge)}},
                   {"type": "text", "text": question(judge.text, prompt, meta)}]
        body = {"model": judge.model, "messages": [{"role": "user", "content": content}],
                "temperature": judge.temperature, "max_tokens": judge.max_tokens, **judge.request}
        bodies.append(json.dumps(body).encode())
    return bodies


def answer_text(data: bytes) -> str:
    """The judge's text in a chat completion; a ValueError for an answer that is not one."""
    try:
        answer = json.loads(data)
        content = answer["choices"][0]["message"]["content"]
    except (ValueError, RecursionError, KeyError, IndexError, TypeError):
        raise ValueError("an answer that is not a chat completion (choices[0].message.content)") from None
    if not isinstance(content, str):
        raise ValueError(f"a chat completion whose content is {type(content).__name__}, not text")
    return content


def parse_score(judge: JudgeConfig, text: str) -> float | None:
    """The score the judge's rule reads in `text`, None when it reads none (or a non-finite one)."""
    if judge.score_regex is not None:
        found = []
        for m in re.finditer(judge.score_regex, text):
            try:
                found.append(float(m.group(1) if m.re.groups else m.group(0)))
            except (TypeError, ValueError):
                continue
            if judge.matches == "first":
                break
        score = sum(found) / len(found) if found else None
    else:
        score = _json_field(text, judge.score_json)
    return score if score is not None and math.isfinite(score) else None


def _json_field(text: str, path: str) -> float | None:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return None
    try:
        value = json.loads(text[start:end + 1])
    except (ValueError, RecursionError):
        return None
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def judge_paths(items: Sequence[str]) -> dict[str, str]:
    """Parse `--reward-judge NAME=FILE` items into {name: file}."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path:
            raise ValueError(f"bad --reward-judge {item!r}: expected NAME=FILE")
        if name.strip() in out:
            raise ValueError(f"bad --reward-judge {item!r}: {name.strip()!r} given twice")
        out[name.strip()] = path
    return out


__all__ = ["JudgeConfig", "answer_text", "encode_requests", "judge_paths", "parse_score", "question"]
