"""DeepSpeed ZeRO-2 and ZeRO-3 through Trainer's ``deepspeed=`` argument, on two CPU processes (DS_ACCELERATOR=cpu,
gloo): the same losses, gradients and weights as one plain process on the whole batch, the EA weights partitioned
by ZeRO-3 like every other weight, and a saved model that reloads in one process with the same logits.

This file is also the script that the two DeepSpeed processes run (``python -m deepspeed.launcher.runner``)."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import transformers

import ea_hf
from ea_hf.modeling.evolution import AttentionMapEvolution

STEPS, GLOBAL_BATCH, SEQ, LR = 2, 4, 16, 0.5


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return ea_hf.patch(transformers.AutoModelForCausalLM.from_config(config), alpha=0.2, beta=0.2)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 128, (STEPS * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def full_weights(model):
    """Every parameter in full (gathered under ZeRO-3, which every process must call)."""
    named = list(model.named_parameters())
    if any(hasattr(parameter, "ds_id") for _, parameter in named):
        import deepspeed

        with deepspeed.zero.GatheredParameters([parameter for _, parameter in named]):
            return {name: parameter.detach().clone() for name, parameter in named}
    return {name: parameter.detach().clone() for name, parameter in named}


class Snapshots(transformers.TrainerCallback):
    def __init__(self):
        self.weights, self.ea_partitions = {}, {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # (the number of elements this process holds, the parameter's full size) of each EA weight
        for name, module in model.named_modules():
            if isinstance(module, AttentionMapEvolution):
                for parameter_name, parameter in module.named_parameters(recurse=False):
                    held = parameter.ds_tensor.numel() if hasattr(parameter, "ds_tensor") else parameter.numel()
                    full = getattr(parameter, "ds_numel", parameter.numel())
                    self.ea_partitions[f"{name}.{parameter_name}"] = (parameter.numel(), held, full)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = full_weights(model)


def train(output_dir, stage=None):
    """Two SGD steps (so that the weights after step 1 give the gradient) on 4 sequences a step, in order."""
    model = tiny_llama()  # before TrainingArguments: no zero.Init, the same weights in every process
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    options = {"use_cpu": True}
    if stage is not None:
        # accelerate 1.15, without CUDA and without cpu=True (which would turn DeepSpeed off), leaves its backend
        # unset and counts one process although DeepSpeed runs two (each would then train on the whole batch):
        # set the state up for DeepSpeed with gloo here, and have TrainingArguments keep it.
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
        options = {
            "accelerator_config": {"use_configured_state": True},
            "deepspeed": {
                "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_allow_untested_optimizer": True,  # Trainer's torch SGD
                "fp16": {"enabled": False},
                "bf16": {"enabled": False},
            },
        }
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=GLOBAL_BATCH // world_size,
        max_steps=STEPS,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        **options,
    )
    assert args.world_size == world_size
    snapshots = Snapshots()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[snapshots])
    trainer.train()
    trainer.save_model(os.path.join(output_dir, "model"))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, snapshots


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: .ci/install leaves DeepSpeed out (a source build, and this test takes minutes of CPU): docs/deepspeed.md.
NO_DEEPSPEED = "DeepSpeed is not installed (pip install deepspeed to run this test)"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason=NO_DEEPSPEED)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_two_cpu_processes_matches_one_process(stage, tmp_path):
    initial = {name: parameter.detach().clone() for name, parameter in tiny_llama().named_parameters()}
    losses, snapshots = train(str(tmp_path / "single"))

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", f"--master_port={free_port()}"]
    completed = subprocess.run(
        [*launch, __file__, "--stage", str(stage), "--output-dir", str(tmp_path / "zero")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-5000:] + completed.stderr[-5000:]
    result = json.loads((tmp_path / "zero" / "result.json").read_text())
    weights = torch.load(tmp_path / "zero" / "weights.pt")

    # The same losses (each the mean over the 4 sequences), the same gradient of step 1 (SGD: (before - after) / lr)
    # and the same weights after step 2, EA weights included.
    assert result["losses"] == pytest.approx(losses, rel=1e-6)
    for name, before in initial.items():
        gradient = (before - snapshots.weights[1][name]) / LR
        assert relative((before - weights[1][name]) / LR, gradient) <= 1e-4, name
        assert relative(weights[2][name], snapshots.weights[2][name]) <= 1e-5, name
    ea_names = [name for name in initial if ".evolving_attention." in name]
    assert len(ea_names) == 4
    # ZeRO-3 partitions the EA weights like every other one (each process holds half, no full copy).
    for name in ea_names:
        held_in_full, held, full = result["ea_partitions"][name]
        if stage == 3:
            assert held_in_full == 0 and held == -(-full // 2), name
        else:
            assert held_in_full == held == full, name

    # The saved model (gathered by stage3_gather_16bit_weights_on_model_save under ZeRO-3) reloads in one process.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "zero" / "model").eval()
    assert ea_hf.is_patched(reloaded)
    for name, parameter in reloaded.named_parameters():
        assert torch.equal(parameter, weights[2][name]), name
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "single" / "model").eval()
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert relative(reloaded(ids).logits, trained(ids).logits) <= 1e-5


def worker():
    """One of the two DeepSpeed processes."""
    import argparse

    import deepspeed.comm.torch

    # DeepSpeed compiles a shared-memory all-reduce for CPU processes when it starts (minutes, the first time);
    # gloo does without it.
    deepspeed.comm.torch.build_shm_op = lambda: None
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int)
    parser.add_argument("--output-dir")
    parser.add_argument("--local_rank", type=int)  # from the DeepSpeed launcher (also in LOCAL_RANK)
    options = parser.parse_args()
    losses, snapshots = train(options.output_dir, options.stage)
    if int(os.environ["RANK"]) == 0:
        torch.save(snapshots.weights, os.path.join(options.output_dir, "weights.pt"))
        result = {"losses": losses, "ea_partitions": snapshots.ea_partitions}
        with open(os.path.join(options.output_dir, "result.json"), "w") as file:
            json.dump(result, file)
    torch.distributed.destroy_process_group()  # before exit: gloo threads left to it may abort the rank


if __name__ == "__main__":
    worker()
