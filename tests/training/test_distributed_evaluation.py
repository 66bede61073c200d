"""Evaluation on two CPU processes (gloo) equals one process: the loss, every metric and the per-example scores, for
every task kind, at evaluation batch sizes 1, 7 and 64, on splits of 11 examples (fewer than a batch of 64, and
not divisible by the process count or by 7). Two processes fill their last batches up with examples from the
start of the split (accelerate's ``even_batches``); the fill-ups must count nowhere.

This file is also the script that the two processes run (``python -m torch.distributed.run``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testing import SST2_SAMPLE, tiny_vit_checkpoint

from ea_hf.training.recipe import load_recipe
from ea_hf.training.run_dir import read_metrics, read_per_example
from ea_hf.training.trainer import evaluate_splits, prepare

BATCH_SIZES = (1, 7, 64)
#: What Trainer reports of the evaluation's speed, not of the model.
TIMINGS = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")
EXAMPLES = 11
_TINY_SERIES = ["model.config.hidden_size=16", "model.config.num_layers=1", "model.config.num_attention_heads=2"]
_TINY_SERIES += ["sweep=null", "variants=null", "pretrain.epochs=0"]
_TINY_LM = ["model.config.hidden_size=32", "model.config.intermediate_size=48", "model.config.num_hidden_layers=1"]
_TINY_LM += ["data.block_size=16", "data.max_eval_samples=2"]


def recipes(folder: Path, digits: dict[str, str], vit: Path) -> dict:
    """One small evaluation of each task kind (and of a regression), untrained: new weights come from the seed,
    the same in every process."""
    limit = f"data.max_eval_samples={EXAMPLES}"
    overrides = {
        "glue": ("quickstart", [*SST2_SAMPLE, limit]),
        "image": ("vision/ea-vit-base-imagenet", [f"model.name_or_path={vit}", "data.source=local", limit]),
        "timeseries": ("timeseries/japanese-vowels", [*_TINY_SERIES, limit]),
        "timeseries-regression": ("timeseries/covid3month", [*_TINY_SERIES, limit]),
        "causal_lm": ("causal_lm/quickstart", _TINY_LM),
    }
    overrides["image"][1].extend([f"data.files={digits}", "data.image_size=24"])
    return {
        name: load_recipe(recipe, [*changes, f"output_dir={folder / name}"])
        for name, (recipe, changes) in overrides.items()
    }


def evaluate_all(folder: Path, digits: dict[str, str], vit: Path) -> None:
    """Evaluate each recipe at each batch size into ``folder/<kind>/batch-<size>`` (metrics and per-example
    scores, as a run writes them)."""
    for name, recipe in recipes(folder, digits, vit).items():
        trainer, splits = prepare(recipe, folder / name, train=False)
        for batch_size in BATCH_SIZES:
            trainer.args.per_device_eval_batch_size = batch_size
            evaluate_splits(trainer, splits, folder / name / f"batch-{batch_size}")


@pytest.mark.slow
@pytest.mark.full_table  # CI's second stage (the fast run's two-process run: test_trainer)
def test_two_processes_evaluate_as_one(tmp_path, digits_folders):
    vit = tiny_vit_checkpoint(tmp_path / "tiny-vit")
    evaluate_all(tmp_path / "one", digits_folders, vit)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    tests = str(Path(__file__).parents[1])
    completed = subprocess.run(
        [*launch, str(tmp_path / "two"), json.dumps(digits_folders), str(vit)],
        env=dict(
            os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])
        ),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    compared = 0
    for name in recipes(tmp_path / "one", digits_folders, vit):
        for batch_size in BATCH_SIZES:
            one, two = (tmp_path / count / name / f"batch-{batch_size}" for count in ("one", "two"))
            expected, got = read_metrics(one), read_metrics(two)
            assert expected.keys() == got.keys() and expected, (name, batch_size)
            for split, metrics in expected.items():
                assert metrics.keys() == got[split].keys()
                for metric, value in metrics.items():
                    if metric in TIMINGS:
                        continue
                    assert got[split][metric] == pytest.approx(value, rel=1e-6, abs=1e-6), (name, batch_size, metric)
                    compared += 1
                scores = read_per_example(one, split)
                if scores is not None:  # each example exactly once, in the split's order
                    assert name == "causal_lm" or len(scores) == EXAMPLES
                    assert read_per_example(two, split) == pytest.approx(scores, rel=1e-6, abs=1e-6)
    assert compared >= 5 * 3 * 2  # every kind and batch size: a loss and at least one metric


def test_the_loss_is_the_mean_over_examples_at_every_batch_size(tmp_path):
    """One process: the loss is the model's own mean over the examples, whatever the batches (a short last batch
    counts for its examples, not as a whole batch)."""
    (recipe,) = [load_recipe("quickstart", [*SST2_SAMPLE, "data.max_eval_samples=9", f"output_dir={tmp_path}"])]
    trainer, splits = prepare(recipe, tmp_path, train=False)
    losses = {}
    for batch_size in (1, 4, 9):
        trainer.args.per_device_eval_batch_size = batch_size
        losses[batch_size] = trainer.evaluate(splits["validation"])["eval_loss"]
    assert losses[4] == pytest.approx(losses[1], rel=1e-6) and losses[9] == pytest.approx(losses[1], rel=1e-6)
    model = trainer.model.eval()
    batch = trainer.data_collator([splits["validation"][i] for i in range(9)])
    with torch.no_grad():
        expected = model(**batch).loss.item()  # one batch of all nine: the model's own mean
    assert losses[1] == pytest.approx(expected, rel=1e-5)


if __name__ == "__main__":  # one of the two processes
    evaluate_all(Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]))
    torch.distributed.destroy_process_group()  # before exit: gloo threads left to it may abort the rank
