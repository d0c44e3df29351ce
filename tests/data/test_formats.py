"""Raw-data layer: reading rows from real local files and parsing them into typed stage examples."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_lightning.data.formats import (
    PreferenceExample,
    PromptExample,
    SFTExample,
    is_conversational,
    parse_preference,
    parse_prompt,
    parse_sft,
)
from rlhf_lightning.data.sources import DataFormatError, Record, read_records


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def read_error(dataset: str, split: str = "train") -> str:
    with pytest.raises(DataFormatError) as info:
        read_records(dataset, split)
    return str(info.value)


def parse_one(tmp_path: Path, parser, row: dict[str, Any]):
    """Parse ``row`` read back from a real JSONL file (so nested values are exactly what JSON yields)."""
    (record,) = read_records(write_jsonl(tmp_path / "data.jsonl", [row]))
    return parser(record)


# --- sources: each file format ------------------------------------------------------------------------


def test_jsonl_skips_blank_lines_but_counts_them(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"a": 1}\n\n   \n{"a": 2, "b": [1, 2]}\n', encoding="utf-8")
    records = read_records(str(path))
    assert records == [
        Record(f"{path} line 1", {"a": 1}),
        Record(f"{path} line 4", {"a": 2, "b": [1, 2]}),
    ]


def test_json_list_file(tmp_path):
    path = tmp_path / "prefs.json"
    path.write_text(json.dumps([{"a": 1}, {"a": 2}], indent=2), encoding="utf-8")
    assert read_records(str(path)) == [Record(f"{path} row 1", {"a": 1}), Record(f"{path} row 2", {"a": 2})]


def test_json_file_falls_back_to_json_lines(tmp_path):
    path = tmp_path / "prefs.json"
    path.write_text('{"a": 1}\n{"a": 2}\n', encoding="utf-8")
    assert read_records(str(path)) == [Record(f"{path} line 1", {"a": 1}), Record(f"{path} line 2", {"a": 2})]


def test_parquet_file_gives_plain_dicts(tmp_path):
    rows = [
        {"prompt": [user("hi")], "chosen": [assistant("yes")], "rejected": [assistant("no")]},
        {"prompt": [user("yo")], "chosen": [assistant("ok")], "rejected": [assistant("meh")]},
    ]
    path = write_parquet(tmp_path / "prefs.parquet", rows)
    records = read_records(path)
    assert [r.where for r in records] == [f"{path} row 1", f"{path} row 2"]
    assert [r.fields for r in records] == rows
    assert type(records[0].fields["prompt"][0]) is dict


def test_saved_dataset_folder(tmp_path):
    folder = str(tmp_path / "saved")
    datasets.Dataset.from_list([{"text": "one"}, {"text": "two"}]).save_to_disk(folder)
    records = read_records(folder)
    assert records == [Record(f"{folder} row 1", {"text": "one"}), Record(f"{folder} row 2", {"text": "two"})]


def test_saved_dataset_dict_picks_split(tmp_path):
    folder = str(tmp_path / "saved_dict")
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"text": "train row"}]),
            "test": datasets.Dataset.from_list([{"text": "test row 1"}, {"text": "test row 2"}]),
        }
    ).save_to_disk(folder)
    assert read_records(folder, split="test") == [
        Record(f"{folder}[test] row 1", {"text": "test row 1"}),
        Record(f"{folder}[test] row 2", {"text": "test row 2"}),
    ]


def test_saved_dataset_dict_missing_split(tmp_path):
    folder = str(tmp_path / "saved_dict")
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"text": "a"}]),
            "test": datasets.Dataset.from_list([{"text": "b"}]),
        }
    ).save_to_disk(folder)
    message = read_error(folder, split="validation")
    assert folder in message
    assert "'validation' not found" in message
    assert "available splits: test, train" in message


def test_plain_folder_goes_through_load_dataset(tmp_path, monkeypatch):
    # Keep the builder's cache inside tmp_path instead of the user's home.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "raw"
    folder.mkdir()
    write_jsonl(folder / "part.jsonl", [{"text": "hello"}, {"text": "world"}])
    records = read_records(str(folder))
    assert records == [
        Record(f"{folder}[train] row 1", {"text": "hello"}),
        Record(f"{folder}[train] row 2", {"text": "world"}),
    ]


def test_load_dataset_errors_are_wrapped(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "nothing_here"
    folder.mkdir()
    with pytest.raises(DataFormatError) as info:
        read_records(str(folder), split="test")
    message = str(info.value)
    assert f"{folder}[test]" in message
    assert "split 'test'" in message
    assert info.value.__cause__ is not None
    assert str(info.value.__cause__) in message


# --- sources: bad input -------------------------------------------------------------------------------


def test_invalid_json_line_is_named_and_quoted(tmp_path):
    path = tmp_path / "prefs.jsonl"
    long_junk = "{oops " + "x" * 200
    path.write_text('{"a": 1}\n\n' + long_junk + "\n", encoding="utf-8")
    message = read_error(str(path))
    assert f"{path} line 3" in message
    assert "invalid JSON" in message
    assert long_junk[:80] in message
    assert long_junk not in message


def test_non_object_line(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text('{"a": 1}\n[1, 2, 3]\n', encoding="utf-8")
    message = read_error(str(path))
    assert f"{path} line 2" in message
    assert "expected a JSON object, found list" in message
    assert "[1, 2, 3]" in message


def test_non_object_item_in_json_list(tmp_path):
    path = tmp_path / "prefs.json"
    path.write_text('[{"a": 1}, "just text"]', encoding="utf-8")
    message = read_error(str(path))
    assert f"{path} row 2" in message
    assert "expected a JSON object, found str" in message


def test_invalid_json_list_names_the_line(tmp_path):
    path = tmp_path / "prefs.json"
    path.write_text('[\n  {"a": 1},\n  {"a": oops}\n]\n', encoding="utf-8")
    message = read_error(str(path))
    assert f"{path} line 3" in message
    assert "invalid JSON" in message
    assert '{"a": oops}' in message


def test_pretty_printed_json_object_is_explained(tmp_path):
    path = tmp_path / "prefs.json"
    path.write_text(json.dumps({"train": [{"a": 1}]}, indent=2), encoding="utf-8")
    message = read_error(str(path))
    assert str(path) in message
    assert "expected a JSON list of objects or one JSON object per line" in message
    assert "dict spanning several lines" in message


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_jsonl_file(tmp_path, content):
    path = tmp_path / "prefs.jsonl"
    path.write_text(content, encoding="utf-8")
    message = read_error(str(path))
    assert str(path) in message
    assert "no rows" in message


def test_empty_json_list(tmp_path):
    path = tmp_path / "prefs.json"
    path.write_text("[]", encoding="utf-8")
    assert "no rows" in read_error(str(path))


def test_zero_row_parquet(tmp_path):
    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    message = read_error(str(path))
    assert str(path) in message
    assert "no rows" in message


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.json", "missing.parquet", "sub/missing.JSONL"])
def test_missing_file(tmp_path, name):
    path = tmp_path / name
    message = read_error(str(path))
    assert str(path) in message
    assert "not found" in message


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "prefs.parquet"
    path.write_bytes(b"definitely not parquet")
    message = read_error(str(path))
    assert str(path) in message
    assert "Parquet" in message


# --- formats: preference ------------------------------------------------------------------------------


def test_explicit_text_preference(tmp_path):
    example = parse_one(tmp_path, parse_preference, {"prompt": "Q?", "chosen": " yes", "rejected": " no"})
    assert example == PreferenceExample(prompt="Q?", chosen=" yes", rejected=" no")
    assert example.margin == 0.0
    assert example.gold_chosen is None and example.gold_rejected is None


def test_explicit_conversational_preference(tmp_path):
    prompt = [{"role": "system", "content": "Be brief."}, user("hi")]
    chosen = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "42"}, assistant("42")]
    example = parse_one(
        tmp_path, parse_preference, {"prompt": prompt, "chosen": chosen, "rejected": [assistant("no")]}
    )
    assert example == PreferenceExample(prompt=prompt, chosen=chosen, rejected=[assistant("no")])
    assert is_conversational(example.prompt)


def test_hh_style_text_prompt_is_backed_off_to_whitespace(tmp_path):
    row = {
        "chosen": "\n\nHuman: hi\n\nAssistant: yes sure",
        "rejected": "\n\nHuman: hi\n\nAssistant: yet no",
    }
    example = parse_one(tmp_path, parse_preference, row)
    assert example.prompt == "\n\nHuman: hi\n\nAssistant:"
    assert example.chosen == " yes sure"
    assert example.rejected == " yet no"


def test_hh_style_multi_turn_text(tmp_path):
    shared = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how?\n\nAssistant:"
    example = parse_one(
        tmp_path, parse_preference, {"chosen": shared + " Like this.", "rejected": shared + " No."}
    )
    assert (example.prompt, example.chosen, example.rejected) == (shared, " Like this.", " No.")


def test_hh_style_text_keeps_whole_whitespace_run_in_completions(tmp_path):
    example = parse_one(
        tmp_path, parse_preference, {"chosen": "Q: why?\n\nBecause.", "rejected": "Q: why?\n\nNo."}
    )
    assert (example.prompt, example.chosen, example.rejected) == ("Q: why?", "\n\nBecause.", "\n\nNo.")


def test_hh_style_conversational_prompt(tmp_path):
    system = {"role": "system", "content": "Be kind."}
    row = {
        "chosen": [system, user("hi"), assistant("hello"), user("help?"), assistant("Sure.")],
        "rejected": [system, user("hi"), assistant("hello"), user("help?"), assistant("No.")],
    }
    example = parse_one(tmp_path, parse_preference, row)
    assert example.prompt == [system, user("hi"), assistant("hello"), user("help?")]
    assert example.chosen == [assistant("Sure.")]
    assert example.rejected == [assistant("No.")]


def test_margin_and_gold_scores_pass_through(tmp_path):
    row = {
        "prompt": "Q",
        "chosen": "a",
        "rejected": "b",
        "margin": 2,
        "gold_chosen": 0.75,
        "gold_rejected": -1,
    }
    example = parse_one(tmp_path, parse_preference, row)
    assert (example.margin, example.gold_chosen, example.gold_rejected) == (2.0, 0.75, -1.0)
    assert type(example.margin) is float and type(example.gold_rejected) is float


def test_null_columns_from_parquet_count_as_absent_but_a_null_prompt_is_a_hole(tmp_path):
    # Arrow fills the second row's missing margin with null: absent, the default margin. A null prompt in a file
    # that has a prompt column is a hole in the data, not the transcript form (which has no prompt column).
    rows = [
        {"prompt": "Q", "chosen": "a", "rejected": "b", "margin": 1.5},
        {"prompt": "R", "chosen": "yes", "rejected": "no"},
        {"chosen": "Q: yes", "rejected": "Q: no"},
    ]
    records = read_records(write_parquet(tmp_path / "mixed.parquet", rows))
    assert records[1].fields["margin"] is None and records[2].fields["prompt"] is None
    assert parse_preference(records[0]) == PreferenceExample("Q", "a", "b", margin=1.5)
    assert parse_preference(records[1]) == PreferenceExample("R", "yes", "no", margin=0.0)
    with pytest.raises(DataFormatError, match=r"mixed.parquet row 3: column 'prompt' is null; give the row a prompt"):
        parse_preference(records[2])
    transcripts = read_records(write_parquet(tmp_path / "hh.parquet", rows[2:]))  # no prompt column at all
    assert parse_preference(transcripts[0]) == PreferenceExample("Q:", " yes", " no", margin=0.0)


# --- formats: SFT and prompts -------------------------------------------------------------------------


def test_sft_prompt_completion_text(tmp_path):
    assert parse_one(tmp_path, parse_sft, {"prompt": "2+2=", "completion": "4"}) == SFTExample("2+2=", "4")


def test_sft_prompt_completion_messages(tmp_path):
    row = {"prompt": [user("2+2?")], "completion": [assistant("4")]}
    assert parse_one(tmp_path, parse_sft, row) == SFTExample([user("2+2?")], [assistant("4")])


def test_sft_text_trains_on_everything(tmp_path):
    assert parse_one(tmp_path, parse_sft, {"text": "All of it."}) == SFTExample("", "All of it.")


def test_sft_messages_splits_off_last_message(tmp_path):
    messages = [user("hi"), assistant("hello"), user("bye"), assistant("ciao")]
    example = parse_one(tmp_path, parse_sft, {"messages": messages})
    assert example == SFTExample(messages[:-1], [assistant("ciao")])


def test_sft_single_assistant_message(tmp_path):
    assert parse_one(tmp_path, parse_sft, {"messages": [assistant("hi")]}) == SFTExample(
        [], [assistant("hi")]
    )


def test_sft_extra_message_keys_are_dropped(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi", "name": None}, assistant("yo")]}
    assert parse_one(tmp_path, parse_sft, row).prompt == [user("hi")]


def test_prompt_text_and_messages(tmp_path):
    assert parse_one(tmp_path, parse_prompt, {"prompt": "Tell me"}) == PromptExample("Tell me")
    conversation = [user("hi"), assistant("hello"), user("more")]
    assert parse_one(tmp_path, parse_prompt, {"prompt": conversation}) == PromptExample(conversation)
    assert not is_conversational("Tell me")


# --- formats: bad input -------------------------------------------------------------------------------

GOOD_MESSAGES = [user("hi")]

BAD_ROWS = [
    # (parser, row, words the message must contain)
    pytest.param(
        parse_preference,
        {"question": "Q", "answer": "A"},
        ["missing columns", "found columns: answer, question", "prompt+chosen+rejected", "chosen+rejected"],
        id="preference-missing-columns",
    ),
    pytest.param(
        parse_preference,
        {"prompt": None, "chosen": "Q: a"},
        ["missing columns", "found columns: chosen", "null: prompt"],
        id="preference-missing-rejected",
    ),
    pytest.param(
        parse_sft,
        {"prompt": "Q"},
        ["missing columns", "found columns: prompt", "prompt+completion, messages, or text"],
        id="sft-missing-columns",
    ),
    pytest.param(
        parse_prompt, {"text": "Q"}, ["missing columns", "found columns: text"], id="prompt-missing"
    ),
    pytest.param(  # a JSONL key with a trailing space: the name is quoted, and the space said
        parse_prompt, {"prompt ": "Q"},
        ["missing columns: expected prompt; found columns: 'prompt '; column 'prompt ' has spaces around its name "
         "(it should read 'prompt')"], id="prompt-with-a-trailing-space"
    ),
    pytest.param(
        parse_preference,
        {"prompt": "Q", "chosen": 3, "rejected": "b"},
        ["column 'chosen'", "expected a string or a list of messages", "found int 3"],
        id="chosen-int",
    ),
    pytest.param(
        parse_preference,
        {"prompt": "Q", "chosen": [assistant("a")], "rejected": [assistant("b")]},
        ["prompt, chosen, rejected", "all strings or all message lists", "prompt: string, chosen: messages"],
        id="mixed-text-and-messages",
    ),
    pytest.param(
        parse_sft,
        {"messages": "hi there"},
        ["column 'messages'", "expected a list of messages", "found str 'hi there'"],
        id="messages-is-string",
    ),
    pytest.param(
        parse_sft, {"text": ["a"]}, ["column 'text'", "expected a string", "found list"], id="text-is-list"
    ),
    pytest.param(
        parse_preference,
        {"prompt": "Q", "chosen": "a", "rejected": ""},
        ["column 'rejected'", "expected a non-empty string", "''"],
        id="empty-rejected",
    ),
    pytest.param(parse_sft, {"text": "  \n"}, ["column 'text'", "non-empty string"], id="blank-text"),
    pytest.param(parse_prompt, {"prompt": ""}, ["column 'prompt'", "non-empty string"], id="empty-prompt"),
    pytest.param(
        parse_prompt, {"prompt": []}, ["column 'prompt'", "non-empty list of messages"], id="empty-messages"
    ),
    pytest.param(
        parse_preference,
        {"prompt": "Q", "chosen": "a", "rejected": "b", "margin": float("nan")},
        ["column 'margin'", "expected a finite number", "nan"],
        id="margin-nan",
    ),
    pytest.param(
        parse_preference,
        {"prompt": "Q", "chosen": "a", "rejected": "b", "margin": float("inf")},
        ["column 'margin'", "expected a finite number", "inf"],
        id="margin-inf",
    ),
    pytest.param(
        parse_preference,
        {"prompt": "Q", "chosen": "a", "rejected": "b", "margin": "big"},
        ["column 'margin'", "expected a finite number", "found str 'big'"],
        id="margin-string",
    ),
    pytest.param(
        parse_preference,
        {"prompt": "Q", "chosen": "a", "rejected": "b", "margin": True},
        ["column 'margin'", "expected a finite number", "found bool True"],
        id="margin-bool",
    ),
    pytest.param(
        parse_preference,
        {"prompt": "Q", "chosen": "a", "rejected": "b", "gold_chosen": "high"},
        ["column 'gold_chosen'", "expected a finite number", "'high'"],
        id="gold-string",
    ),
    pytest.param(
        parse_prompt,
        {"prompt": [user("hi"), {"role": "user", "text": "oops"}]},
        ["column 'prompt' message 2 of 2", "missing 'content'", "found keys: role, text"],
        id="message-without-content",
    ),
    pytest.param(
        parse_prompt,
        {"prompt": [{"role": "bot", "content": "hi"}]},
        ["column 'prompt' message 1 of 1", "expected a role in system, user, assistant, tool", "'bot'"],
        id="message-unknown-role",
    ),
    pytest.param(
        parse_sft,
        {"messages": [user("hi"), {"role": "assistant", "content": 5}]},
        ["column 'messages' message 2 of 2", "'content' to be a string", "found int 5"],
        id="message-content-int",
    ),
    pytest.param(
        parse_sft,
        {"messages": [user("hi"), "hello"]},
        [
            "column 'messages' message 2 of 2",
            "expected a dict with 'role' and 'content'",
            "found str 'hello'",
        ],
        id="message-not-dict",
    ),
    pytest.param(
        parse_sft,
        {"messages": [user("hi"), assistant("")]},
        ["column 'messages' message 2 of 2", "non-empty 'content'"],
        id="message-empty-content",
    ),
    pytest.param(
        parse_preference,
        {"chosen": "Q: same", "rejected": "Q: same"},
        ["'chosen' and 'rejected'", "two different responses", "identical"],
        id="identical-hh-text",
    ),
    pytest.param(
        parse_preference,
        {"prompt": GOOD_MESSAGES, "chosen": [assistant("a")], "rejected": [assistant("a")]},
        ["'chosen' and 'rejected'", "identical"],
        id="identical-explicit-messages",
    ),
    pytest.param(
        parse_preference,
        {"prompt": GOOD_MESSAGES, "chosen": [assistant("a"), user("b")], "rejected": [assistant("c")]},
        ["column 'chosen'", "last message to be from the assistant", "found role 'user'"],
        id="explicit-chosen-ends-with-user",
    ),
    pytest.param(
        parse_preference,
        {"chosen": [user("hi"), assistant("a")], "rejected": [user("hi"), assistant("b"), user("again")]},
        ["column 'rejected'", "last message to be from the assistant", "found role 'user'"],
        id="hh-messages-rejected-ends-with-user",
    ),
    pytest.param(
        parse_sft,
        {"prompt": GOOD_MESSAGES, "completion": [user("me again")]},
        ["column 'completion'", "last message to be from the assistant", "found role 'user'"],
        id="sft-completion-ends-with-user",
    ),
    pytest.param(
        parse_sft,
        {"messages": [assistant("hi"), user("bye")]},
        ["column 'messages'", "last message to be from the assistant", "found role 'user'"],
        id="sft-messages-end-with-user",
    ),
    pytest.param(
        parse_prompt,
        {"prompt": [user("hi"), assistant("hello")]},
        ["column 'prompt'", "found a message from the assistant", "'hello'"],
        id="prompt-ends-with-assistant",
    ),
    pytest.param(
        parse_preference,
        {"chosen": [user("hi"), assistant("a")], "rejected": [user("hi"), assistant("a"), assistant("b")]},
        ["column 'chosen'", "reply after the 2 shared prompt message(s)", "found none"],
        id="hh-messages-nothing-left",
    ),
    pytest.param(
        parse_preference,
        {"chosen": "Q: yes ", "rejected": "Q: yes please"},
        ["column 'chosen'", "expected a response after the shared prompt", "found nothing"],
        id="hh-text-nothing-left",
    ),
    pytest.param(
        parse_preference,
        {"chosen": "yes indeed", "rejected": "no way"},
        ["'chosen' and 'rejected'", "shared prompt", "'prompt' column"],
        id="hh-text-no-shared-prompt",
    ),
    pytest.param(
        parse_preference,
        {"chosen": [user("a"), assistant("x")], "rejected": [user("b"), assistant("y")]},
        ["'chosen' and 'rejected'", "different first messages"],
        id="hh-messages-no-shared-prompt",
    ),
]


@pytest.mark.parametrize(("parser", "row", "words"), BAD_ROWS)
def test_bad_rows_name_file_line_and_problem(tmp_path, parser, row, words):
    path = tmp_path / "bad_rows.jsonl"
    # The blank first line makes the bad row line 2, so the test checks that blank lines are counted.
    path.write_text("\n" + json.dumps(row) + "\n", encoding="utf-8")
    (record,) = read_records(str(path))
    with pytest.raises(DataFormatError) as info:
        parser(record)
    message = str(info.value)
    assert message.startswith(f"{path} line 2: ")
    for word in words:
        assert word in message


def test_bad_margin_from_parquet_names_the_row(tmp_path):
    rows = [{"prompt": "Q", "chosen": "a", "rejected": "b", "margin": m} for m in (1.0, math.nan)]
    records = read_records(write_parquet(tmp_path / "prefs.parquet", rows))
    assert parse_preference(records[0]).margin == 1.0
    with pytest.raises(
        DataFormatError, match=r"prefs\.parquet row 2: column 'margin': expected a finite number"
    ):
        parse_preference(records[1])


def test_errors_are_value_errors():
    assert issubclass(DataFormatError, ValueError)
