"""Fault injection: ``ea-hf`` killed with SIGKILL at chosen points (while saving a checkpoint, while writing the
evaluation, during a push), then run again, and a run directory on a disk that fills up. A killed run finishes
with ``--resume`` at the metrics and weights of a run that was never killed; a killed push leaves the Hub
repository at its previous commit, and the retry completes; a full disk stops the run with one error, and
``--resume`` finishes it once there is space.

The kill is exact rather than timed: the command runs in a child process in which one function is wrapped to
kill the process at its n-th call, before or after the call runs (the same place every time, whatever the
machine's speed)."""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
import transformers
from safetensors.torch import load_file
from testing import SST2_SAMPLE, tiny_checkpoint

from ea_hf import is_patched
from ea_hf.training.run_dir import last_complete_checkpoint, read_metrics, write_atomically, write_metrics

#: Six steps of a tiny BERT, a checkpoint every two: each child process is mostly its imports.
SHORT = [
    *SST2_SAMPLE,
    "data.max_train_samples=48",
    "data.max_eval_samples=24",
    "train.batch_size=8",
    "train.max_steps=6",
    "train.eval_strategy=no",
    "train.save_strategy=steps",
    "train.save_steps=2",
    "train.save_total_limit=null",
    "train.logging_steps=2",
]

#: Where a run is killed: (module, function, which call, before or after it runs).
KILL_POINTS = {
    # After checkpoint-4's model is written, before its optimizer and trainer state are: a torn checkpoint.
    "saving checkpoint 4": ("transformers.trainer", "Trainer._save_optimizer_and_scheduler", 2, "before"),
    # One file of the evaluation written (the validation metrics), the per-example scores not yet.
    "writing the evaluation": ("ea_hf.training.run_dir", "write_atomically", 1, "after"),
}

#: A fork server: it imports ea-hf and what a run imports (about 15 seconds, most of a short run) once, then for
#: each request forks a child process that wraps the kill point, runs ``ea-hf`` with its arguments and exits as
#: ``python -c`` would (a traceback and status 1 for an uncaught exception, exit handlers run). The server reports
#: the child's exit status (negative: the signal that killed it). Each child is a separate process killed by a
#: real SIGKILL; it only starts from modules already imported.
SERVER = """
import importlib, json, os, sys

for module_name in sys.argv[1:]:
    importlib.import_module(module_name)
for request in map(json.loads, sys.stdin):
    child = os.fork()
    if child == 0:
        break
    _, status = os.waitpid(child, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
else:
    sys.exit(0)

# The child: stdin from /dev/null, stdout and stderr to the request's files, then the run.
import functools, signal

os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.dup2(os.open(request["stdout"], os.O_WRONLY), 1)
os.dup2(os.open(request["stderr"], os.O_WRONLY), 2)
module_name, path, at_call, when = request["kill_at"]
owner = importlib.import_module(module_name)
*parents, name = path.split(".")
for parent in parents:
    owner = getattr(owner, parent)
original, calls = getattr(owner, name), [0]

@functools.wraps(original)
def killing(*args, **kwargs):
    calls[0] += 1
    if calls[0] == at_call and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = original(*args, **kwargs)
    if calls[0] == at_call:
        os.kill(os.getpid(), signal.SIGKILL)
    return result

setattr(owner, name, killing)
from ea_hf.cli import main
sys.exit(main(request["arguments"]))
"""
#: What the server imports before it forks: ea-hf's command line, the modules a run, a push and the kill points
#: import on first use.
PRELOAD = ["ea_hf.cli", "ea_hf.cli.commands", "ea_hf.training.trainer", "transformers.trainer", "datasets"]
PRELOAD += [
    "evaluate",
    "sklearn.metrics",
    "huggingface_hub.hf_api",
    "ea_hf.training.run_dir",
    "ea_hf.training.evidence",
]
NO_KILL = ("os", "getpid", 0, "before")
_servers = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_servers():
    yield
    while _servers:
        server = _servers.popitem()[1]
        server.kill()  # it holds nothing to save: its exit would only spend seconds tearing down its modules
        server.wait()


def ea_hf(arguments, kill_at=NO_KILL, env=None):
    """Run ``ea-hf ARGUMENTS`` in a child process, killed at ``kill_at`` (a KILL_POINTS value). A server per
    environment: huggingface_hub reads its settings when it is imported."""
    env = {**os.environ, **(env or {})}
    key = tuple(sorted(env.items()))
    if key not in _servers:
        command = [sys.executable, "-c", textwrap.dedent(SERVER), *PRELOAD]
        _servers[key] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    server = _servers[key]
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (out, err):
            open(path, "w").close()
        request = {"arguments": list(map(str, arguments)), "kill_at": kill_at, "stdout": out, "stderr": err}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], 600)
        assert ready, "the run did not end within 10 minutes"
        returncode = int(server.stdout.readline())
        with open(out) as stdout, open(err) as stderr:
            return subprocess.CompletedProcess(arguments, returncode, stdout.read(), stderr.read())


def finished(done):
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def run_quickstart(tmp_path_factory, minilm_tokenizer):
    """``ea-hf run quickstart`` on a tiny checkpoint, in a run directory: its arguments."""
    checkpoint = tiny_checkpoint("bert", minilm_tokenizer, tmp_path_factory.mktemp("checkpoint"))
    return lambda run_dir, *flags: ["run", "quickstart", *SHORT, f"model.name_or_path={checkpoint}",
                                    f"output_dir={run_dir}", *flags]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, run_quickstart):
    run_dir = tmp_path_factory.mktemp("runs") / "straight"
    finished(ea_hf(run_quickstart(run_dir)))
    return run_dir


@pytest.mark.slow
# The fast run kills at the first point; CI's second stage at every other.
@pytest.mark.parametrize(
    "point", [pytest.param(point, marks=pytest.mark.full_table if i else ()) for i, point in enumerate(KILL_POINTS)]
)
def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_result(point, run_quickstart, uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    killed = ea_hf(run_quickstart(run_dir), kill_at=KILL_POINTS[point])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    if point == "saving checkpoint 4":  # the torn checkpoint is there, but a resume does not take it
        assert (run_dir / "checkpoints" / "checkpoint-4" / "model.safetensors").is_file()
        assert last_complete_checkpoint(run_dir) == str(run_dir / "checkpoints" / "checkpoint-2")
    if point == "writing the evaluation":  # a model and part of an evaluation: not a finished run
        refused = ea_hf(run_quickstart(run_dir, "--skip-finished"))
        assert refused.returncode == 2 and "already holds a run" in refused.stderr, refused.stderr[-3000:]

    finished(ea_hf(run_quickstart(run_dir, "--resume")))
    expected, got = read_metrics(uninterrupted)["validation"], read_metrics(run_dir)["validation"]
    assert got["accuracy"] == expected["accuracy"]
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert (run_dir / "eval" / "validation" / "per_example.json").read_text() == (
        uninterrupted / "eval" / "validation" / "per_example.json"
    ).read_text()
    ours, theirs = load_file(str(run_dir / "model.safetensors")), load_file(str(uninterrupted / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    # The resume replays the remaining batches from the checkpoint's RNG state; summation order may differ.
    worst = max((ours[name] - theirs[name]).abs().max().item() for name in ours)
    assert worst <= 1e-5, worst
    if point == "writing the evaluation":
        assert "is finished; skipped" in finished(ea_hf(run_quickstart(run_dir, "--skip-finished"))).stderr


#: The causal-LM quickstart made tiny (a 1-layer Llama trained from scratch, blocks of 32 tokens), six steps with a
#: checkpoint every two: the other kind of run, killed where a checkpoint is torn.
SHORT_CAUSAL_LM = ["model.config.hidden_size=32", "model.config.intermediate_size=48"]
SHORT_CAUSAL_LM += ["model.config.num_hidden_layers=1", "data.block_size=32", "data.max_train_samples=64"]
SHORT_CAUSAL_LM += ["data.max_eval_samples=16", "train.max_steps=6", "train.eval_strategy=no", "train.logging_steps=2"]
SHORT_CAUSAL_LM += ["train.save_strategy=steps", "train.save_steps=2", "train.save_total_limit=null"]


@pytest.mark.slow
@pytest.mark.full_table  # CI's second stage: the fast run kills a quickstart run while it saves
def test_a_causal_lm_run_killed_while_saving_resumes_to_the_uninterrupted_result(tmp_path):
    def arguments(run_dir, *flags):
        return ["run", "causal_lm/quickstart", *SHORT_CAUSAL_LM, f"output_dir={run_dir}", *flags]

    finished(ea_hf(arguments(tmp_path / "straight")))
    killed = ea_hf(arguments(tmp_path / "run"), kill_at=KILL_POINTS["saving checkpoint 4"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert last_complete_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "checkpoints" / "checkpoint-2")
    finished(ea_hf(arguments(tmp_path / "run", "--resume")))
    expected, got = read_metrics(tmp_path / "straight")["validation"], read_metrics(tmp_path / "run")["validation"]
    assert got["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-5)
    ours, theirs = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("run", "straight"))
    assert ours.keys() == theirs.keys()
    assert max((ours[name] - theirs[name]).abs().max().item() for name in ours) <= 1e-5


def test_the_last_complete_checkpoint_passes_over_torn_and_foreign_folders(tmp_path):
    assert last_complete_checkpoint(tmp_path) is None  # no checkpoints folder: a resume starts afresh
    folder = tmp_path / "checkpoints"
    for step, state in [(2, "{}"), (4, '{"global_step": 4}'), (6, '{"global_st'), (8, None)]:
        (folder / f"checkpoint-{step}").mkdir(parents=True)
        if state is not None:
            (folder / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    (folder / "checkpoint-latest").mkdir()
    assert last_complete_checkpoint(tmp_path) == str(folder / "checkpoint-4")


def test_a_write_interrupted_before_its_rename_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """What ``ea-hf card -o`` and the evaluation files rely on (a SIGKILL there is the same as this)."""
    card = tmp_path / "README.md"
    card.write_text("the card as the user edited it\n")

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(card, "---\nthe new card\n")
    assert card.read_text() == "the card as the user edited it\n" and sorted(tmp_path.iterdir()) == [card]
    monkeypatch.undo()
    write_atomically(card, "---\nthe new card\n")
    assert card.read_text() == "---\nthe new card\n" and sorted(tmp_path.iterdir()) == [card]


@pytest.mark.slow
def test_a_killed_push_leaves_the_previous_commit_and_a_retry_completes(uninterrupted, hub, tmp_path):
    env = {"HF_TOKEN": "hf_test_token", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
    env |= {"HF_HOME": str(tmp_path / "home"), "HF_ENDPOINT": hub.endpoint}
    push = ["push", str(uninterrupted), "--repo-id", "test-user/killed", "--endpoint", hub.endpoint]
    finished(ea_hf(push, env=env))
    before, files = hub.commits("test-user/killed"), hub.files("test-user/killed")
    assert "model.safetensors" in files and "README.md" in files

    metrics = read_metrics(uninterrupted)["validation"]  # a new evaluation: the card changes, a new commit is due
    write_metrics(uninterrupted, "validation", {**metrics, "accuracy": 0.123})
    try:
        # Killed once the blobs are sent and before the commit that would make them part of the repository.
        killed = ea_hf(push, kill_at=("huggingface_hub.hf_api", "HfApi.preupload_lfs_files", 1, "after"), env=env)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert hub.commits("test-user/killed") == before and hub.files("test-user/killed") == files
        finished(ea_hf(push, env=env))
    finally:
        write_metrics(uninterrupted, "validation", metrics)
    after = hub.commits("test-user/killed")
    assert after[:-1] == before and len(after) == len(before) + 1, (before, after)
    card = hub.files("test-user/killed")["README.md"].decode()
    assert "value: 0.123" in card
    assert json.loads(hub.files("test-user/killed")["config.json"])["model_type"] == "ea-bert"


@contextlib.contextmanager
def small_disk(folder, size):
    """A tmpfs of ``size`` mounted on ``folder`` for the duration (root only), whose size can be changed."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (root needed): {mounted.stderr.decode().strip()}")
    try:
        yield lambda size: subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.full_table  # CI's second stage: fast: a killed run resumes
@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_one_error_and_resume_finishes_once_space_is_freed(
    run_quickstart, uninterrupted, tmp_path
):
    # 20 MB: room for the first checkpoint (13 MB: a tiny BERT with MiniLM's vocabulary, its Adam state and
    # tokenizer), not for the second.
    with small_disk(tmp_path / "disk", "20m") as resize:
        run_dir = tmp_path / "disk" / "run"
        full = ea_hf(run_quickstart(run_dir))
        assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
        (error,) = [line for line in full.stderr.splitlines() if line.startswith("ea-hf run: error:")]
        last = run_dir / "checkpoints" / "checkpoint-2"
        assert f"no space left on the disk of {run_dir}" in error, error
        assert f"the last complete checkpoint is {last}" in error and error.endswith("continue with --resume")
        assert last_complete_checkpoint(run_dir) == str(last)
        assert is_patched(transformers.AutoModelForSequenceClassification.from_pretrained(last))

        resize("128m")  # space freed
        finished(ea_hf(run_quickstart(run_dir, "--resume")))
        expected, got = read_metrics(uninterrupted)["validation"], read_metrics(run_dir)["validation"]
        assert got["accuracy"] == expected["accuracy"]
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
