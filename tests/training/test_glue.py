"""GLUE: every task's local loading, label casting, tokenisation and metric, on small generated samples."""

import math

import datasets
import pytest
from testing import FORMATS, LABELS, sample_rows, write

from ea_hf.training.kinds.glue import GLUE_TASKS, cast_labels, load_glue_data, load_glue_metric, tokenize


@pytest.mark.parametrize("task", list(GLUE_TASKS))
def test_local_files_load_with_the_task_columns_and_labels(task, tmp_path, minilm_tokenizer):
    spec = GLUE_TASKS[task]
    fmt = FORMATS[list(GLUE_TASKS).index(task) % len(FORMATS)]
    files = {"train": write(sample_rows(task), tmp_path / f"train.{fmt}")}
    for split in spec.eval_splits:  # eval splits give labels as names where the task has classes
        files[split] = write(sample_rows(task, 6, as_names=not spec.is_regression), tmp_path / f"{split}.{fmt}")
    data = load_glue_data(task, source="local", files=files)
    assert list(data) == ["train", *spec.eval_splits]
    label = data["train"].features["label"]
    if spec.is_regression:
        assert label == datasets.Value("float32")
        assert data["train"]["label"][-1] == 5.0
    else:
        assert isinstance(label, datasets.ClassLabel) and tuple(label.names) == spec.label_names
        expected = [LABELS[i] if spec.num_labels == 2 else i % 3 for i in range(6)]
        assert data[spec.eval_splits[0]]["label"] == expected  # names mapped to the task's ids

    encoded = tokenize(data["train"], spec, minilm_tokenizer, max_length=16)
    assert set(encoded.column_names) >= {"input_ids", "attention_mask", "labels"}
    assert "sentence" not in encoded.column_names and "idx" not in encoded.column_names
    separators = encoded[0]["input_ids"].count(minilm_tokenizer.sep_token_id)
    assert separators == len(spec.text_columns)  # one [SEP] per segment: pairs are encoded as pairs
    assert max(len(ids) for ids in encoded["input_ids"]) <= 16


def test_wnli_label_order_is_its_own():
    assert GLUE_TASKS["wnli"].label_names == ("not_entailment", "entailment")
    assert GLUE_TASKS["rte"].label_names == ("entailment", "not_entailment")
    ds = datasets.Dataset.from_list([{"sentence1": "a", "sentence2": "b", "label": "entailment"}])
    assert cast_labels(ds, GLUE_TASKS["wnli"])["label"] == [1]
    assert cast_labels(ds, GLUE_TASKS["rte"])["label"] == [0]


def test_bad_data_is_reported_clearly(tmp_path):
    bad_names = write([{"sentence": "x", "label": "great"}], tmp_path / "a.csv")
    with pytest.raises(ValueError, match=r"unknown label\(s\) \['great'\]; expected \['negative', 'positive'\]"):
        load_glue_data("sst2", "local", files={"train": bad_names})
    bad_ids = write([{"sentence": "x", "label": 3}], tmp_path / "b.csv")
    with pytest.raises(ValueError, match=r"label id\(s\) \[3\] outside 0..1"):
        load_glue_data("sst2", "local", files={"train": bad_ids})
    wrong_columns = write([{"text": "x", "label": 0}], tmp_path / "c.csv")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['sentence'\]"):
        load_glue_data("sst2", "local", files={"train": wrong_columns})
    with pytest.raises(FileNotFoundError, match="not found"):
        load_glue_data("sst2", "local", files={"train": str(tmp_path / "missing.csv")})


PREDICTIONS = [1, 1, 0, 0, 1, 0, 1, 1]
REFERENCES = [1, 0, 0, 0, 1, 1, 1, 1]  # tp=4 fp=1 fn=1 tn=2


@pytest.mark.parametrize("task", list(GLUE_TASKS))
def test_each_task_has_its_glue_metric(task):
    metric = load_glue_metric(task)
    spec = GLUE_TASKS[task]
    if spec.is_regression:
        result = metric.compute(predictions=[0.0, 1.0, 2.0, 4.0], references=[0.0, 1.0, 2.0, 3.0])
        # pearson of (0,1,2,4) with (0,1,2,3), by hand: cov / (sd_x sd_y)
        x, y = [0, 1, 2, 4], [0, 1, 2, 3]
        mx, my = sum(x) / 4, sum(y) / 4
        cov = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
        expected = cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
        assert result["pearson"] == pytest.approx(expected, abs=1e-6)
        assert result["spearmanr"] == pytest.approx(1.0)
        return
    result = metric.compute(predictions=PREDICTIONS, references=REFERENCES)
    assert set(result) == set(spec.metrics)
    if "accuracy" in result:
        assert result["accuracy"] == pytest.approx(6 / 8)
    if "f1" in result:
        assert result["f1"] == pytest.approx(2 * 4 / (2 * 4 + 1 + 1))
    if "matthews_correlation" in result:
        tp, fp, fn, tn = 4, 1, 1, 2
        mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
        assert result["matthews_correlation"] == pytest.approx(mcc)
