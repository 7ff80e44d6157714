"""Plain datasets into the pipeline's rows: presets (GSM8K, MATH), column mapping, template,
system prompt, and the formats read (JSONL, Parquet, CSV, a saved DatasetDict)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from grpo_core.config.stages import DataConfig
from grpo_core.contracts.columns import RowMapping
from grpo_core.contracts.prompts import load_rows
from grpo_core.errors import UserError

GSM8K = [
    {
        "question": "A shop sells 400 pens a day. How many in 2.5 days?",
        "answer": "400*2.5=<<400*2.5=1000>>1000 pens.\n#### 1,000",
    },
    {"question": "Tom has 3 cats and 2 dogs. How many pets?", "answer": "3+2=<<3+2=5>>5\n#### 5"},
]
MATH = [
    {
        "problem": "What is $1/2 + 1/4$?",
        "solution": "We get $\\frac{2}{4}+\\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
        "level": "Level 1",
    },
    {"problem": "Compute $2^3$.", "solution": "$2^3 = \\boxed{8}$", "level": "Level 2"},
]
SYSTEM = "Think inside <think></think>, then answer inside <answer></answer>."


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_preset_extracts_the_answer_and_builds_chat_prompts_and_sft_targets(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    m = DataConfig(
        source="files",
        sft_path="x",
        rl_path="x",
        eval_path="x",
        preset="gsm8k",
        system_prompt=SYSTEM,
    ).mapping()
    rl = load_rows(path, mapping=m)
    assert rl[0]["answer"] == "1000" and rl[1]["answer"] == "5"
    assert rl[0]["prompt"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": GSM8K[0]["question"]},
    ]
    assert "completion" not in rl[0] and "question" not in rl[0]
    sft = load_rows(path, required=("prompt", "completion"), mapping=m)
    assert sft[0]["completion"] == "<think>400*2.5=1000 pens.</think><answer>1000</answer>"


def test_math_preset_takes_the_last_boxed_answer_with_nested_braces(tmp_path):
    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(MATH), path)
    rows = load_rows(path, mapping=RowMapping(preset="math"))
    assert [r["answer"] for r in rows] == ["\\frac{3}{4}", "8"]
    assert rows[0]["prompt"] == [{"role": "user", "content": MATH[0]["problem"]}]
    assert rows[0]["level"] == "Level 1"  # unconsumed columns pass through to rewards


def test_a_saved_datasetdict_split_is_named_after_two_colons(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict(
        {"train": Dataset.from_list(GSM8K), "test": Dataset.from_list(GSM8K[:1])}
    ).save_to_disk(str(tmp_path / "gsm8k"))
    m = RowMapping(preset="gsm8k")
    assert len(load_rows(f"{tmp_path / 'gsm8k'}::train", mapping=m)) == 2
    assert [r["answer"] for r in load_rows(f"{tmp_path / 'gsm8k'}::test", mapping=m)] == ["1000"]
    with pytest.raises(UserError, match=r"splits train, test; name one as .*gsm8k::train"):
        load_rows(tmp_path / "gsm8k", mapping=m)
    with pytest.raises(UserError, match=r"no split 'dev'; the dataset has train, test"):
        load_rows(f"{tmp_path / 'gsm8k'}::dev", mapping=m)
    Dataset.from_list(MATH).save_to_disk(str(tmp_path / "math"))  # a single Dataset
    assert len(load_rows(tmp_path / "math", mapping=RowMapping(preset="math"))) == 2


def test_csv_through_load_dataset_with_a_template_and_an_answer_column(tmp_path):
    path = tmp_path / "plain.csv"
    path.write_text("a,b,label\n2,3,5\n10,4,14\n")
    m = RowMapping(template="What is {a} plus {b}?", answer_column="label", chat=False)
    rows = load_rows(path, mapping=m)
    assert rows[0]["prompt"] == "What is 2 plus 3?" and rows[0]["answer"] == 5
    assert rows[1]["a"] == 10 and "label" not in rows[1]


def test_system_prompt_is_not_added_twice_and_columns_map_by_name(tmp_path):
    rows = [
        {
            "msgs": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}],
            "gold": "1",
        },
        {"msgs": [{"role": "user", "content": "q2"}], "gold": "2"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    m = RowMapping(prompt_column="msgs", answer_column="gold", system_prompt=SYSTEM)
    out = load_rows(path, mapping=m)
    assert (
        out[0]["prompt"][0] == {"role": "system", "content": "own"} and len(out[0]["prompt"]) == 2
    )
    assert out[1]["prompt"][0] == {"role": "system", "content": SYSTEM}
    assert [r["answer"] for r in out] == ["1", "2"]


def test_rows_without_mapping_settings_pass_unchanged(tmp_path):
    rows = [{"prompt": "2+2=", "answer": "4"}]
    path = write_jsonl(tmp_path / "plain.jsonl", rows)
    assert RowMapping().identity
    assert load_rows(path, mapping=RowMapping()) == rows


@pytest.mark.parametrize(
    ("mapping", "rows", "message"),
    [
        (
            RowMapping(preset="gsm8k"),
            [GSM8K[0], {"question": "q", "answer": "no final line"}],
            r"bad\.jsonl, row 1, column 'answer': expected a final '#### <answer>' line",
        ),
        (
            RowMapping(preset="math"),
            [{"problem": "p", "solution": "the answer is 3"}],
            r"bad\.jsonl, row 0, column 'solution': expected a \\boxed\{\.\.\.\} answer",
        ),
        (
            RowMapping(prompt_column="question"),
            [{"question": "q", "answer": "1"}, {"text": "q", "answer": "1"}],
            r"bad\.jsonl, row 1: missing column 'question' \(the prompt\); has answer, text",
        ),
        (
            RowMapping(template="Solve: {question}"),
            [{"problem": "q"}],
            r"bad\.jsonl, row 0: data.template names column 'question', which the row does not "
            r"have \(has problem\)",
        ),
    ],
)
def test_bad_rows_name_the_file_row_and_column(tmp_path, mapping, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError, match=message):
        load_rows(path, mapping=mapping)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"template": "no columns here"}, "names no column"),
        ({"template": "Solve {0}"}, "use column names in braces"),
        ({"system_prompt": "s", "chat": False}, "data.system_prompt needs chat prompts"),
        ({"preset": "mbpp"}, "preset"),
    ],
)
def test_bad_mapping_settings_fail_at_config_load(settings, message):
    with pytest.raises(ValidationError, match=message):
        DataConfig(**settings)


def test_word_problems_have_disjoint_splits_and_r1_targets():
    from grpo_core.demo.word_problems import make_splits

    s = make_splits(0, n_sft=50, n_rl=200, n_dev=10, n_eval=40)
    questions = [r["prompt"][0]["content"] for split in (s.sft, s.rl, s.dev, s.eval) for r in split]
    assert len(set(questions)) == len(questions) == 300
    row = s.sft[0]
    assert row["completion"].endswith(f"<answer>{row['answer']}</answer>")
    assert all(int(r["answer"]) >= 0 for r in s.eval)
    assert make_splits(0, n_sft=50, n_rl=200, n_dev=10, n_eval=40) == s


def test_prepare_writes_mapped_splits_into_the_workspace(tmp_path):
    from grpo_core.config.stages import ModelConfig
    from tasks.prepare import prepare
    from tasks.workspace import Workspace

    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    data = DataConfig(
        source="files",
        sft_path=str(path),
        rl_path=str(path),
        eval_path=str(path),
        preset="gsm8k",
        system_prompt=SYSTEM,
    )
    ws = Workspace.create(str(tmp_path / "runs"), "t")
    out = prepare.fn(data, ModelConfig(source="demo"), 0, ws)
    eval_rows = load_rows(out["eval"])
    assert out["eval"] == str(ws.data("eval")) and eval_rows[0]["answer"] == "1000"
    assert load_rows(out["sft"], required=("prompt", "completion"))[1]["completion"].endswith(
        "<answer>5</answer>"
    )


def test_a_folder_of_data_files_goes_through_load_dataset(tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", GSM8K)
    write_jsonl(folder / "test.jsonl", GSM8K[:1])
    m = RowMapping(preset="gsm8k")
    assert [r["answer"] for r in load_rows(f"{folder}::test", mapping=m)] == ["1000"]
    assert len(load_rows(f"{folder}::train", mapping=m)) == 2
    with pytest.raises(UserError, match="a file has no splits"):
        load_rows(f"{folder / 'train.jsonl'}::train")
