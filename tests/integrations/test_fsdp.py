"""FSDP2 (torch's ``fully_shard``, through accelerate) for the causal-LM recipe on two CPU processes over gloo:
``ea-hf run ... --nproc-per-node 2 train.fsdp=true``. Each step's loss and gradients match one process on the
whole batch, which would catch gloo summing the gradients instead of averaging them (torch#162338); the EA
weights are sharded like every other weight; the saved model is whole and reloads in one process.

This file is also the script that the two processes run (``python -m torch.distributed.run``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import ea_hf
from ea_hf.training.recipe import load_recipe
from ea_hf.training.trainer import run_recipe

#: The causal-LM quickstart made tiny; plain SGD at a constant rate, so that nothing rescales the gradients.
OVERRIDES = ["model.config.hidden_size=32", "model.config.intermediate_size=48", "model.config.num_hidden_layers=2"]
OVERRIDES += ["data.block_size=32", "data.max_train_samples=64", "data.max_eval_samples=16", "train.max_steps=2"]
OVERRIDES += ["train.eval_strategy=no", "train.logging_steps=1", "train.optimizer=sgd", "train.momentum=0"]
OVERRIDES += ["train.warmup_ratio=0", "train.lr_scheduler=constant", "train.learning_rate=0.1"]
GLOBAL_BATCH = 4


class GradientRecorder(transformers.TrainerCallback):
    """Each step's loss and gradients, whole (a shard gathered), and each parameter's class and local shape."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.placement: dict[str, tuple[str, list[int]]] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for name, parameter in model.named_parameters():
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            self.placement[name] = (type(parameter).__name__, list(local.shape))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        gradients = {}
        for name, parameter in model.named_parameters():  # every process gathers: a collective
            grad = parameter.grad
            gradients[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
        self.gradients.append(gradients)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.losses.append(logs["loss"])


def close(tensor, reference, rtol, atol):
    """Within ``rtol`` of the reference's norm (plus ``atol``), as a whole: a sum over processes where a mean
    belongs doubles the norm, while rounding moves single small elements by more than ``rtol`` of themselves."""
    return (tensor - reference).norm().item() <= rtol * reference.norm().item() + atol


def train(run_dir, *overrides):
    recorder = GradientRecorder()
    metrics = run_recipe(
        load_recipe("causal_lm/quickstart", [*OVERRIDES, f"output_dir={run_dir}", *overrides]), callbacks=[recorder]
    )
    return recorder, metrics


@pytest.mark.slow
@pytest.mark.full_table  # CI's second stage (the fast run's two-process run: test_trainer)
def test_fsdp2_on_two_cpu_processes_matches_one_process(tmp_path):
    single, single_metrics = train(tmp_path / "single", f"train.batch_size={GLOBAL_BATCH}")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    completed = subprocess.run(
        [*launch, str(tmp_path / "fsdp")],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    sharded = torch.load(tmp_path / "fsdp" / "recorded.pt")

    # Each process saw half of each batch of 4 blocks; their mean loss and averaged gradients are those of one
    # process on the whole batch (gradients summed over the processes would be twice as large).
    assert sharded["losses"] == pytest.approx(single.losses, rel=1e-5)
    assert len(sharded["gradients"]) == len(single.gradients) == 2
    for step, (expected, gathered) in enumerate(zip(single.gradients, sharded["gradients"], strict=True)):
        assert expected.keys() == gathered.keys()
        for name, gradient in expected.items():
            # (the last layer's convolution bias has a zero gradient up to rounding: softmax ignores a shift)
            assert close(gathered[name], gradient, 1e-3, 1e-9), (step, name)

    # Every weight, the evolution's included, is a DTensor of which each process holds half the rows.
    ea_names = [name for name in sharded["placement"] if ".evolving_attention." in name]
    assert len(ea_names) == 4
    for name, (kind, local_shape) in sharded["placement"].items():
        full_shape = list(single.gradients[0][name].shape)
        assert kind == "DTensor" and local_shape == [-(-full_shape[0] // 2), *full_shape[1:]], name

    # The saved model is whole, an ordinary EA checkpoint (its remote code ea_hf's, not torch's FSDP classes),
    # and reloads in one process with the weights of the single-process run.
    run_dir = tmp_path / "fsdp" / "run"
    auto_map = json.loads((run_dir / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "model_classes.EALlamaForCausalLM"
    assert not list(run_dir.glob("_fsdp*.py"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir)
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "single")
    assert ea_hf.is_patched(reloaded)
    for (name, weight), reference in zip(reloaded.state_dict().items(), expected.state_dict().values(), strict=True):
        assert close(weight, reference, 1e-5, 0.0), name
    assert sharded["metrics"]["validation"]["perplexity"] == pytest.approx(
        single_metrics["validation"]["perplexity"], rel=1e-5
    )


if __name__ == "__main__":  # one of the two processes
    output = Path(sys.argv[1])
    recorder, metrics = train(output / "run", f"train.batch_size={GLOBAL_BATCH // 2}", "train.fsdp=true")
    if torch.distributed.get_rank() == 0:
        torch.save(
            {
                "losses": recorder.losses,
                "gradients": recorder.gradients,
                "placement": recorder.placement,
                "metrics": metrics,
            },
            output / "recorded.pt",
        )
    torch.distributed.destroy_process_group()  # before exit: gloo threads left to it may abort the rank
