"""Running recipes end to end on the offline quickstart: training, metrics, the saved model, eval, compare,
baseline, the separate EA learning rate and resuming an interrupted run."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from testing import SST2_SAMPLE, sample_rows, tiny_checkpoint, write

import ea_hf
from ea_hf.cli import main
from ea_hf.modeling.evolution import AttentionMapEvolution
from ea_hf.training.kinds.glue import GLUE_TASKS
from ea_hf.training.ramp import EvolutionRamp
from ea_hf.training.recipe import load_recipe
from ea_hf.training.run_dir import read_metrics, read_per_example
from ea_hf.training.trainer import ProgressWithThreads, evaluate_run, evolution_parameters, prepare, run_recipe

SHORT = [
    *SST2_SAMPLE,
    "data.max_train_samples=48",
    "data.max_eval_samples=24",
    "train.batch_size=8",
    "train.max_steps=4",
    "train.eval_strategy=steps",
    "train.eval_steps=2",
    "train.save_strategy=steps",
    "train.save_steps=2",
    "train.logging_steps=2",
]


def short_quickstart(run_dir, *overrides):
    return load_recipe("quickstart", [*SHORT, f"output_dir={run_dir}", *overrides])


def test_quickstart_runs_and_saves_everything(tmp_path, capsys):
    run_dir = tmp_path / "ea"
    assert main(["run", "quickstart", *SHORT, f"output_dir={run_dir}"]) == 0
    # Where it prints its result, what the evidence says of its EA settings against the baseline.
    evidence = load_recipe(run_dir / "recipe.yaml").evidence
    assert "ea-hf run quickstart ea.enabled=false" in evidence
    assert capsys.readouterr().out.endswith(f"\n\n{evidence}\n")
    files = {p.name for p in run_dir.iterdir()}
    assert {"recipe.yaml", "config.json", "model.safetensors", "model_classes.py", "tokenizer.json"} <= files
    metrics = json.loads((run_dir / "eval" / "validation" / "metrics.json").read_text())
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["epoch"] > 0
    assert load_recipe(run_dir / "recipe.yaml").train.max_steps == 4  # the resolved recipe
    # Each validation sentence's correctness, in order: their mean is the accuracy.
    correct = read_per_example(run_dir, "validation")
    assert len(correct) == 24 and set(correct) <= {0.0, 1.0}
    assert sum(correct) / len(correct) == pytest.approx(metrics["accuracy"], abs=1e-12)

    model = transformers.AutoModelForSequenceClassification.from_pretrained(run_dir)
    assert type(model).__name__ == "EABertForSequenceClassification"
    assert model.config.id2label == {0: "negative", 1: "positive"}
    capsys.readouterr()

    # `eval` re-evaluates the saved model and finds the same numbers.
    assert main(["eval", str(run_dir)]) == 0
    assert read_metrics(run_dir)["validation"]["accuracy"] == metrics["accuracy"]
    assert abs(read_metrics(run_dir)["validation"]["loss"] - metrics["loss"]) <= 1e-6

    # The baseline is the same recipe with EA off; `compare` shows both.
    baseline = tmp_path / "baseline"
    assert main(["run", "quickstart", *SHORT, f"output_dir={baseline}", "ea.enabled=false"]) == 0
    plain = transformers.AutoModelForSequenceClassification.from_pretrained(baseline)
    assert type(plain).__name__ == "BertForSequenceClassification" and not ea_hf.is_patched(plain)
    assert evidence not in capsys.readouterr().out  # the baseline has no EA settings to speak of
    assert main(["compare", str(run_dir), str(baseline)]) == 0
    table = capsys.readouterr().out
    assert "a=0 b=0 k=3 learned gates" in table and " off " in table and table.count("accuracy=") == 2

    # An existing run is never overwritten; --skip-finished leaves it as it is and goes on.
    assert main(["run", "quickstart", *SHORT, f"output_dir={run_dir}"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    before = (run_dir / "model.safetensors").stat().st_mtime_ns
    assert main(["run", "quickstart", *SHORT, f"output_dir={run_dir}", "--skip-finished"]) == 0
    assert f"{run_dir} is finished; skipped" in capsys.readouterr().err
    assert (run_dir / "model.safetensors").stat().st_mtime_ns == before


def test_a_ramp_starts_from_the_checkpoint_and_reaches_the_full_alpha_and_beta(tmp_path):
    recipe = short_quickstart(tmp_path / "ramp", "ea.gates=fixed", "ea.ramp_ratio=0.5", "ea.alpha=0.4", "ea.beta=0.2")
    seen = RecordEvolution()
    trainer, eval_splits = prepare(recipe, tmp_path / "ramp", callbacks=[seen])
    batch = next(iter(trainer.get_eval_dataloader(eval_splits["validation"])))
    unpatched = transformers.AutoModelForSequenceClassification.from_pretrained(
        trainer.model.config._name_or_path, num_labels=2
    )
    unpatched.load_state_dict(trainer.model.state_dict(), strict=False)  # the same head, no evolution
    evolution = next(m for m in trainer.model.modules() if isinstance(m, AttentionMapEvolution))
    ramp = next(c for c in trainer.callback_handler.callbacks if isinstance(c, EvolutionRamp))
    ramp._scale(0.0)
    with torch.no_grad():  # alpha = beta = 0: the patched model computes what the checkpoint does
        torch.testing.assert_close(trainer.model.eval()(**batch).logits, unpatched.eval()(**batch).logits)
    trainer.train()
    # 4 steps, a ramp over 2: 0 and 1/2 of the values, then all of them; the full values stay after training.
    assert seen.values == [(0.0, 0.0), (0.2, 0.1), (0.4, 0.2), (0.4, 0.2)]
    assert (evolution.alpha, evolution.beta) == (0.4, 0.2)
    assert trainer.model.config.evolving_attention["encoder"]["alpha"] == 0.4


class RecordEvolution(transformers.TrainerCallback):
    """alpha and beta of the first evolution as each training step begins (after the ramp has set them)."""

    def __init__(self) -> None:
        self.values = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        evolution = next(m for m in model.modules() if isinstance(m, AttentionMapEvolution))
        self.values.append((round(evolution.alpha, 6), round(evolution.beta, 6)))


def test_evolution_parameters_get_their_own_learning_rate(tmp_path):
    recipe = short_quickstart(tmp_path / "lr", "ea.learning_rate=0.005")
    trainer, _ = prepare(recipe, tmp_path / "lr")
    optimizer = trainer.create_optimizer()
    evolution = {id(p) for p in evolution_parameters(trainer.model)}
    assert len(evolution) == 4 * 6  # per layer: the convolution's weight and bias, the two learned gates
    groups = [g for g in optimizer.param_groups if {id(p) for p in g["params"]} & evolution]
    assert len(groups) == 1 and groups[0]["lr"] == 0.005 and {id(p) for p in groups[0]["params"]} == evolution
    others = [g for g in optimizer.param_groups if g is not groups[0]]
    assert {g["lr"] for g in others} == {1e-4}
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(trainer.model.parameters()))
    # Its progress bar is the one that shows the threads in use (below).
    bars = [c for c in trainer.callback_handler.callbacks if isinstance(c, transformers.ProgressCallback)]
    assert [type(bar) for bar in bars] == [ProgressWithThreads]


def test_the_progress_bar_shows_the_threads_in_use_and_the_load():
    """On a shared machine a run slows down by as much as others take of the cores: the bar says what it has."""
    progress, state = ProgressWithThreads(), transformers.TrainerState(max_steps=2)
    progress.on_train_begin(None, state, None)
    threads, cores = torch.get_num_threads(), os.cpu_count()
    # tqdm ends a description with ": "
    assert re.fullmatch(rf"{threads} threads?, load \d+\.\d on {cores} cores: ", progress.training_bar.desc)
    state.global_step = 1
    progress.on_step_end(None, state, None)
    assert progress.training_bar.n == 1 and progress.training_bar.desc.startswith(f"{threads} thread")
    progress.on_train_end(None, state, None)


class Interrupt(transformers.TrainerCallback):
    """Kills training after the step given, as a crash or Ctrl-C would."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at_step:
            raise KeyboardInterrupt


class CountSteps(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


@pytest.mark.full_table  # CI's second stage: fast: test_fault_injection resumes
def test_an_interrupted_run_resumes_from_its_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    recipe = short_quickstart(run_dir)
    with pytest.raises(KeyboardInterrupt):
        run_recipe(recipe, callbacks=[Interrupt(at_step=3)])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert not (run_dir / "eval").exists()

    counter = CountSteps()
    metrics = run_recipe(recipe, resume=True, callbacks=[counter])
    assert counter.steps == [3, 4]  # continued after checkpoint-2 instead of starting over
    assert "accuracy" in metrics["validation"]
    state = json.loads((run_dir / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4

    # The resumed run ends where an uninterrupted one does.
    straight = run_recipe(short_quickstart(tmp_path / "straight"))
    resumed_model = transformers.AutoModelForSequenceClassification.from_pretrained(run_dir)
    straight_model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "straight")
    for (name, a), b in zip(resumed_model.state_dict().items(), straight_model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), (name, (a - b).abs().max().item())
    assert straight["validation"]["accuracy"] == metrics["validation"]["accuracy"]


LAUNCHERS = {
    # Overrides after the option, as people type it.
    "ea-hf --nproc-per-node": lambda args: main(["run", args[0], "--nproc-per-node", "2", *args[1:]]),
    "accelerate launch": lambda args: subprocess.call(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes=2", "--num_machines=1", "--multi_gpu"]
        + ["-m", "ea_hf.cli", "run", *args]
    ),
}


@pytest.mark.slow
# The fast run launches through ea-hf; CI's second stage through accelerate too.
@pytest.mark.parametrize(
    "launcher", [pytest.param(name, marks=pytest.mark.full_table if i else ()) for i, name in enumerate(LAUNCHERS)]
)
def test_two_cpu_processes_train_the_quickstart_data_parallel(tmp_path, launcher):
    run_dir = tmp_path / "ddp"
    # One epoch of 48 samples in batches of 8: 6 steps in one process, 3 when two processes share the data.
    overrides = [*SST2_SAMPLE, "data.max_train_samples=48", "data.max_eval_samples=24", "train.batch_size=8"]
    overrides += ["train.epochs=1", "train.save_strategy=epoch"]  # evaluation batches of 64: a part-filled one
    assert LAUNCHERS[launcher](["quickstart", *overrides, f"output_dir={run_dir}"]) == 0

    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["epoch"] == 1.0
    metrics = read_metrics(run_dir)["validation"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(run_dir)
    assert ea_hf.is_patched(model)
    # The saved model is the trained one: evaluating it again in this process gives the run's numbers.
    assert evaluate_run(run_dir)["validation"]["accuracy"] == metrics["accuracy"]
    assert abs(read_metrics(run_dir)["validation"]["loss"] - metrics["loss"]) <= 1e-6


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_a_lora_run_saves_what_reproduces_its_metrics(tmp_path, merge):
    run_dir = tmp_path / "lora"
    metrics = run_recipe(short_quickstart(run_dir, "peft.method=lora", "peft.r=4", f"peft.merge={str(merge).lower()}"))
    files = {p.name for p in run_dir.iterdir()}
    assert "tokenizer.json" in files
    if merge:  # an ordinary EA checkpoint
        assert "model.safetensors" in files and "adapter_config.json" not in files
        model = transformers.AutoModelForSequenceClassification.from_pretrained(run_dir)
        assert type(model).__name__ == "EABertForSequenceClassification"
    else:  # only the adapter: LoRA matrices, evolution convolutions and gates, and classifier
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
        from safetensors.torch import load_file

        names = load_file(run_dir / "adapter_model.safetensors").keys()
        assert sum("evolving_attention" in n for n in names) == 4 * 6 and sum("lora_A" in n for n in names) == 6 * 3
        assert all("lora_" in n or "evolving_attention" in n or "classifier" in n for n in names)
    again = evaluate_run(run_dir)["validation"]
    assert again["accuracy"] == metrics["validation"]["accuracy"]
    assert abs(again["loss"] - metrics["validation"]["loss"]) <= 1e-5


@pytest.mark.parametrize(
    ("paper_model", "model_type", "task", "dropout_attribute"),
    [
        ("ea-bert-base", "bert", "rte", "hidden_dropout_prob"),
        ("ea-roberta-large", "roberta", "mrpc", "attention_probs_dropout_prob"),
        ("ea-t5-base", "t5", "stsb", "dropout_rate"),
    ],
)
def test_the_papers_recipes_run_end_to_end_on_tiny_stand_ins(
    paper_model, model_type, task, dropout_attribute, tmp_path, minilm_tokenizer
):
    """The shipped recipe, with only the checkpoint and data swapped for offline stand-ins."""
    checkpoint = tiny_checkpoint(model_type, minilm_tokenizer, tmp_path / "checkpoint", GLUE_TASKS[task].num_labels)
    files = {"train": write(sample_rows(task, 8), tmp_path / "train.tsv")}
    files["validation"] = write(sample_rows(task, 6), tmp_path / "validation.tsv")
    overrides = ["sweep=null", f"model.name_or_path={checkpoint}", "data.source=local", f"data.files={files}"]
    overrides += ["train.max_steps=3", "train.batch_size=4", f"output_dir={tmp_path / 'run'}"]
    recipe = load_recipe(f"glue/{paper_model}/{task}", overrides)
    metrics = run_recipe(recipe)["validation"]
    assert set(GLUE_TASKS[task].metrics) <= set(metrics) and all(math.isfinite(metrics[m]) for m in metrics)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "run")
    assert ea_hf.is_patched(model) and type(model).__name__.startswith("EA")
    assert getattr(model.config, dropout_attribute) == 0.1  # the paper's dropout, whatever the config calls it
    assert model.config.num_labels == GLUE_TASKS[task].num_labels
