"""GLUE metrics as an ``evaluate`` module, loaded from this folder so that nothing is fetched from the Hub.

``evaluate.load("glue", task)`` downloads its script and fails offline;
``ea_hf.training.kinds.glue.load_glue_metric(task)`` loads this file instead. The metrics are the ones GLUE
defines: Matthews correlation (CoLA), F1 and accuracy (MRPC, QQP), Pearson and Spearman correlation (STS-B),
accuracy (the others).
"""

import datasets
import evaluate
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

_CITATION = """\
@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={International Conference on Learning Representations},
  year={2019}
}
"""

_DESCRIPTION = "GLUE metrics: Matthews correlation, F1/accuracy, Pearson/Spearman or accuracy, by task."

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (class ids; floats for stsb).
    references: gold labels.
Returns:
    cola: matthews_correlation; mrpc, qqp: f1, accuracy; stsb: pearson, spearmanr;
    sst2, mnli, mnli_matched, mnli_mismatched, qnli, rte, wnli, ax: accuracy.
"""

TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli", "ax")


def _accuracy(predictions, references):
    return float(sum(int(p == r) for p, r in zip(predictions, references, strict=True)) / len(references))


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name not in TASKS:
            raise KeyError(f"Unknown GLUE task {self.config_name!r}; expected one of {', '.join(TASKS)}")
        value = datasets.Value("float32" if self.config_name == "stsb" else "int64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": value, "references": value}),
            format="numpy",
        )

    def _compute(self, predictions, references):
        task = self.config_name
        if task == "cola":
            return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
        if task == "stsb":
            return {
                "pearson": float(pearsonr(predictions, references)[0]),
                "spearmanr": float(spearmanr(predictions, references)[0]),
            }
        if task in ("mrpc", "qqp"):
            return {
                "f1": float(f1_score(y_true=references, y_pred=predictions)),
                "accuracy": _accuracy(predictions, references),
            }
        return {"accuracy": _accuracy(predictions, references)}
