"""Prompt sets: a .txt file (one prompt per line) or a .jsonl file (a `prompt` field plus free metadata;
`height`, `width` and `frames`, when present, give the prompt its own shape: prompts/resolutions.py).

A run reads each prompt file once, before anything loads (`read_prompt_file`, through
config.validate.RunFacts), and keeps the records: a file edited while the model loads cannot change
the prompts a run trains on, and the SHA-256 of the bytes it read goes into config.json and every
checkpoint, so a resume can tell when the file changed since."""
from __future__ import annotations

import hashlib
import io
import json
import os
import stat
from dataclasses import dataclass, field


SHAPE_FIELDS = ("height", "width", "frames")


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    metadata: dict = field(default_factory=dict)
    line: int = 0  # line in the prompt file (1-based; 0: not from a file), for error messages


@dataclass(frozen=True)
class PromptSet:
    """The records of one prompt file as read once, and the SHA-256 of the bytes they came from."""

    path: str
    records: tuple[PromptRecord, ...]
    sha256: str


def read_prompt_file(path: str) -> PromptSet:
    """The prompt file `path`, read once: a ValueError names a missing, unreadable or malformed file."""
    if not os.path.lexists(path):
        raise ValueError(f"prompt file {path!r} does not exist")
    check_regular(path, "prompt file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:  # a folder, a broken link or a symlink loop, no permission
        raise ValueError(f"prompt file {path!r} cannot be read ({e.strerror})") from None
    return PromptSet(path, tuple(_parse(path, raw)), hashlib.sha256(raw).hexdigest())


def check_regular(path: str, what: str) -> None:
    """`path` is a regular file (through links): a FIFO with no writer would block the reader, and
    every rank with it, for ever; a device or a socket is no file to read whole."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:  # a broken link or a symlink loop, no permission
        raise ValueError(f"{what} {path!r} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFDIR: "a folder", stat.S_IFSOCK: "a socket",
                stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}.get(stat.S_IFMT(mode), "not a file")
        raise ValueError(f"{what} {path!r} is {kind}, not a regular file: a run reads its files whole before it "
                         f"starts")


def load_prompts(path: str) -> list[PromptRecord]:
    return list(read_prompt_file(path).records)


def _parse(path: str, raw: bytes) -> list[PromptRecord]:
    records: list[PromptRecord] = []
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"prompt file {path!r} is not UTF-8 text: line {line} holds the byte "
                         f"0x{raw[e.start]:02x} ({e.reason}); save it as UTF-8") from None
    lines = list(io.StringIO(text, newline=None))  # the lines a text-mode open() would give
    if path.endswith(".jsonl"):
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{n}: each jsonl line needs a string field 'prompt'")
            for key in SHAPE_FIELDS:
                value = obj.get(key)
                if key in obj and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"{path}:{n}: {key!r} must be a positive integer, got {value!r}")
            records.append(PromptRecord(obj["prompt"], {k: v for k, v in obj.items() if k != "prompt"}, n))
    else:
        records = [PromptRecord(line.strip(), line=n) for n, line in enumerate(lines, 1) if line.strip()]
    if not records:
        raise ValueError(f"prompt file {path!r} holds no prompts")
    return records


def eval_records(path: str, num_prompts: int | None, samples_per_prompt: int = 1,
                 prompts: PromptSet | None = None) -> list[PromptRecord]:
    """The first `num_prompts` prompts of `path` (None: all; `prompts`: the file as already read),
    each repeated `samples_per_prompt` times in a row. Every copy is its own sample id, hence its
    own fixed seed."""
    if (num_prompts is not None and num_prompts < 1) or samples_per_prompt < 1:
        raise ValueError(f"evaluation needs >= 1 prompt and >= 1 sample per prompt, got {num_prompts} prompts x "
                         f"{samples_per_prompt} samples")
    records = (prompts or read_prompt_file(path)).records
    return [r for r in records[:num_prompts] for _ in range(samples_per_prompt)]
