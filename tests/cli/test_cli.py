"""The ``ea-hf`` command line."""

import json
import re

import numpy as np
import pytest
import torch
import transformers
from testing import tiny_model

import ea_hf
from ea_hf.cli import build_parser, main
from ea_hf.training.run_dir import read_metrics


def test_patch_command_writes_a_loadable_checkpoint_with_tokenizer(minilm_path, tmp_path, capsys):
    out = tmp_path / "ea"
    assert (
        main(["patch", minilm_path, str(out), "--alpha", "0.3", "--beta", "0.1", "--layers", "1,3", "--seed", "5"]) == 0
    )
    printed = capsys.readouterr().out
    assert "2 evolving attention modules, 2,616 added parameters" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["evolving_attention"]["encoder"] == {
        "alpha": 0.3,
        "beta": 0.1,
        "kernel_size": 3,
        "layers": [1, 3],
        "init": "kaiming_uniform",
        "method": "conv",
    }
    assert (out / "tokenizer.json").exists()
    model = transformers.AutoModel.from_pretrained(out)
    assert [m.layer for m in ea_hf.summary(model).modules] == [1, 3]

    # Same seed, same weights: the command is reproducible.
    again = tmp_path / "again"
    assert (
        main(["patch", minilm_path, str(again), "--alpha", "0.3", "--beta", "0.1", "--layers", "1,3", "--seed", "5"])
        == 0
    )
    other = transformers.AutoModel.from_pretrained(again)
    first = model.encoder.layer[1].attention.self.evolving_attention.weight
    assert torch.equal(first, other.encoder.layer[1].attention.self.evolving_attention.weight)

    assert main(["summary", str(out)]) == 0
    assert "encoder.layer.3.attention.self.evolving_attention" in capsys.readouterr().out


def test_patch_command_errors_are_clear_and_nonzero(minilm_path, tmp_path, capsys):
    assert main(["patch", minilm_path, str(tmp_path / "x"), "--alpha", "2"]) == 2
    assert "alpha must be in [0, 1], got 2.0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["patch", minilm_path, str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert main(["summary", minilm_path]) == 2
    assert "is not an evolving attention checkpoint" in capsys.readouterr().err
    for missing in ("/no/such/dir", "./no-such-dir", "no/such/dir"):  # paths, not Hub ids
        assert main(["patch", missing, str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert f"ea-hf patch: error: {missing} does not exist (neither a local directory nor a Hub id)" in err
        assert "Repo id must be in the form" not in err and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_info:  # argparse's own error: the choices come from the settings
        main(["patch", minilm_path, str(tmp_path / "x"), "--method", "cnov"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'cnov' (choose from 'conv', 'residual', 'echo', 'linear')" in capsys.readouterr().err


def test_patch_command_takes_per_role_settings_for_seq2seq_models(tmp_path, capsys):
    plain = tmp_path / "t5"
    tiny_model("t5", transformers.AutoModelForSeq2SeqLM).save_pretrained(plain)
    out = tmp_path / "ea"
    assert (
        main(
            [
                "patch",
                str(plain),
                str(out),
                "--alpha",
                "0.3",
                "--decoder",
                '{"alpha": 0.1, "layers": [2]}',
                "--cross",
                "off",
            ]
        )
        == 0
    )
    stored = json.loads((out / "config.json").read_text())["evolving_attention"]
    assert set(stored) == {"encoder", "decoder"}
    assert (stored["decoder"]["alpha"], stored["decoder"]["layers"]) == (0.1, [2])
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out)
    assert [(m.role, m.layer) for m in ea_hf.summary(model).modules] == [
        ("encoder", 0),
        ("encoder", 1),
        ("encoder", 2),
        ("decoder", 2),
    ]
    capsys.readouterr()

    assert main(["patch", str(plain), str(tmp_path / "bad"), "--cross", '{"beta": 3}']) == 2
    assert "cross: Invalid evolving-attention settings: beta must be in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["patch", str(plain), str(tmp_path / "bad"), "--decoder", "alpha=0.1"])
    assert exit_info.value.code == 2
    assert 'expected "off" or a JSON object' in capsys.readouterr().err


def test_recipe_commands_list_copy_and_validate(tmp_path, capsys):
    assert main(["ls"]) == 0
    assert "quickstart" in capsys.readouterr().out
    assert main(["cp", "quickstart", str(tmp_path)]) == 0
    copy = tmp_path / "quickstart.yaml"
    assert copy.exists()
    assert main(["cp", "quickstart", str(tmp_path)]) == 2  # never overwrites
    assert "exists; not overwriting" in capsys.readouterr().err
    # The copy still finds the sample data although it moved away from recipes/.
    assert main(["validate", str(copy), "ea.alpha=0.4"]) == 0
    assert "valid (1 run)" in capsys.readouterr().out
    assert main(["validate", str(copy), "train.lerning_rate=1e-5", "data.task=stsbb"]) == 2
    err = capsys.readouterr().err
    assert "2 problems in the recipe" in err
    assert "train.lerning_rate: unknown key (did you mean 'learning_rate'?)" in err
    assert "data.task: unknown GLUE task 'stsbb' (did you mean 'stsb'?)" in err


def test_ls_sizes_its_name_column_to_the_longest_name(capsys):
    from ea_hf.training.recipe import list_recipes, recipe_name

    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [recipe_name(path) for path in list_recipes()]
    width = max(len(name) for name in names)
    assert [line[:width].rstrip() for line in lines] == names
    assert all(line[width : width + 2] == "  " and line[width + 2] != " " for line in lines)


def test_an_unknown_recipe_name_suggests_one_and_points_to_ls(capsys):
    for command in (["run", "quikstart"], ["validate", "quikstart"], ["cp", "quikstart", "."]):
        assert main(command) == 2
        assert (
            f"ea-hf {command[0]}: error: no recipe file 'quikstart' (did you mean 'quickstart'?); see `ea-hf ls` "
            "for the shipped recipes"
        ) in capsys.readouterr().err


def test_help_states_each_default_once(capsys):
    """Every option's help says its default at most once, as "(default: ...)", not also in a bare parenthesis
    ("(all) (default: all)")."""
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    helps = {
        f"{name} {'/'.join(action.option_strings) or action.dest}": action.help or ""
        for name, command in subparsers.choices.items()
        for action in command._actions
    }
    assert len(helps) > 60
    assert [key for key, text in helps.items() if text.count("default") > 1] == []
    assert helps["patch --layers"] == "indices of the layers to patch (default: all)"
    assert helps["patch --alpha"] == (
        "weight of the previous layer's logits, in [0, 1] (default: 0.2; 0 for echo and linear)"
    )
    assert (
        helps["patch --beta"] == "weight of the convolution branch, in [0, 1] (default: 0.2; 0 for residual and echo)"
    )
    assert helps["patch --seed"] == "seed for the new convolution weights (default: 0)"
    # Defaults stated in a bare parenthesis, the other style: none left.
    bare = re.compile(r"\((all|mean|\d+|[\w.]+\.png|the first)\)")
    assert [key for key, text in helps.items() if bare.search(text)] == []


def test_run_options_and_overrides_mix_and_bad_input_fails_early(tmp_path, capsys):
    run_dir = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "quickstart", "--resume", f"output_dir={run_dir}", "--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    # Overrides after an option are overrides; a bad one fails before anything is launched or written.
    assert main(["run", "quickstart", "--nproc-per-node", "2", f"output_dir={run_dir}", "ea.alpah=1"]) == 2
    assert "ea.alpah: unknown key (did you mean 'alpha'?)" in capsys.readouterr().err
    assert main(["run", "quickstart", "--nproc-per-node", "0", f"output_dir={run_dir}"]) == 2
    assert "--nproc-per-node must be at least 1" in capsys.readouterr().err
    assert not run_dir.exists()


def test_a_multi_run_recipe_reports_progress_and_ends_with_the_table(tmp_path, capsys):
    tiny = ["model.config.hidden_size=32", "model.config.intermediate_size=48", "model.config.num_hidden_layers=1"]
    tiny += ["data.block_size=32", "data.max_train_samples=2", "data.max_eval_samples=1", "train.max_steps=2"]
    tiny += ["train.eval_strategy=no", "sweep={train.seed: [1, 2]}", f"output_dir={tmp_path}"]
    evidence = (
        "These settings: 0.5 points below the baseline. The baseline: ea-hf run causal_lm/quickstart ea.enabled=false"
    )
    assert main(["run", "causal_lm/quickstart", *tiny, f"evidence='{evidence}'"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith(f"\n\n{evidence}\n")  # the recipe's evidence, once, after the result
    assert f"[ea-hf] run 1 of 2: {tmp_path}/seed=1\n" in err
    assert re.search(
        rf"\[ea-hf\] run 2 of 2: {re.escape(str(tmp_path))}/seed=2 \(1 done in 0 min \d+ s; about 0 min \d+ s left\)",
        err,
    )
    assert not re.search(r": \{'", out)  # no raw result dict above the table
    lines = out.strip().splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("run "))) :][:3]  # header, 2 runs
    assert table[0].split()[:2] == ["run", "task"] and [row.split()[0] for row in table[1:]] == [
        f"{tmp_path}/seed=1",
        f"{tmp_path}/seed=2",
    ]
    # Runs that differ only by seed are pooled: one model, its mean and std, nothing to pair it with.
    perplexities = [read_metrics(tmp_path / f"seed={seed}")["validation"]["perplexity"] for seed in (1, 2)]
    assert lines[lines.index("perplexity on validation (lower is better):") + 4] == (
        f"| {tmp_path.name} | 2 | {np.mean(perplexities):.4f} ± {np.std(perplexities, ddof=1):.4f} "
        f"| {perplexities[0]:.4f}, {perplexities[1]:.4f} |"
    )
