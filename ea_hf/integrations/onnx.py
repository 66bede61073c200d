"""ONNX export of EA models (and of plain ones): ``model.onnx`` with dynamic batch and sequence axes, beside the
``config.json`` and tokenizer (or image processor) files that optimum's ``ORTModelFor...`` classes and onnxruntime
users read. ``ea-hf export --onnx RUN_DIR`` runs :func:`export_checkpoint`.

The graph is traced by torch's ONNX exporter (``torch.onnx.export(..., dynamo=True)``). The fused kernels of
``ea_hf.ops`` decline while it traces (``ea_hf.ops.fused_step.tracing_without_kernels``: ONNX has no translation of
their torch operators), so the graph holds the evolution step's torch operations, which compute the same to float
rounding; a plain ``torch.onnx.export`` of a patched model works the same way. Heads: sequence classifiers
(``text-classification``), causal language models (``text-generation``: the logits of a forward without cache, a
prefill) and image classifiers (``image-classification``).

Needs the ``onnx`` extra (``pip install "ea_hf[onnx]"``: onnx, onnxscript and onnxruntime, which checks the graph).

Example:
    >>> head = head_of("EABertForSequenceClassification")
    >>> head.task, head.auto_class
    ('text-classification', 'AutoModelForSequenceClassification')
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import transformers
from torch import nn

from ..modeling.attach import is_patched
from ..modeling.patching import unpatch
from .peft import ADAPTER_CONFIG

ONNX_FILE = "model.onnx"
#: The shapes (batch, tokens) of the padded batches that the graph is traced with and checked with: different, so
#: that the check runs the dynamic axes at a shape the trace did not see.
TRACE_SHAPE = (2, 7)
CHECK_SHAPE = (3, 12)
#: The names of the dynamic axes in the graph, as optimum's exports name them.
BATCH_AXIS, SEQUENCE_AXIS = "batch_size", "sequence_length"


@dataclasses.dataclass(frozen=True)
class OnnxHead:
    """A model head that exports: optimum's ``task`` name, the transformers Auto class that loads it, the ending
    of its architecture names, and the inputs its graph may take (those the model's ``forward`` has; a
    tokenizer's ``token_type_ids`` only where the tokenizer makes them)."""

    task: str
    auto_class: str
    suffix: str
    inputs: tuple[str, ...]

    @property
    def text(self) -> bool:
        return "input_ids" in self.inputs

    @property
    def causal(self) -> bool:
        return self.task == "text-generation"


HEADS = (
    OnnxHead(
        "text-classification",
        "AutoModelForSequenceClassification",
        "ForSequenceClassification",
        ("input_ids", "attention_mask", "token_type_ids"),
    ),
    OnnxHead("text-generation", "AutoModelForCausalLM", "ForCausalLM", ("input_ids", "attention_mask", "position_ids")),
    OnnxHead("image-classification", "AutoModelForImageClassification", "ForImageClassification", ("pixel_values",)),
)


@dataclasses.dataclass(frozen=True)
class OnnxExport:
    """What :func:`export_model` wrote: the graph's ``path``, its ``head`` and ``inputs`` (in order; the output is
    ``logits``), and the largest difference between onnxruntime's logits and PyTorch's on a batch of another shape
    than the traced one (padded; real tokens only for a causal LM), or None without onnxruntime."""

    path: Path
    head: OnnxHead
    inputs: tuple[str, ...]
    max_difference: float | None


def head_of(architecture: str) -> OnnxHead:
    """The :class:`OnnxHead` of an architecture name (``EABertForSequenceClassification``), or a ValueError that
    says which heads export."""
    for head in HEADS:
        if architecture.endswith(head.suffix):
            return head
    supported = ", ".join(f"...{head.suffix} ({head.task})" for head in HEADS)
    raise ValueError(f"{architecture} does not export to ONNX: the heads that do are {supported}")


def check_exportable(model_dir: str | Path) -> OnnxHead:
    """The head of the model saved in ``model_dir`` (a run directory or a saved checkpoint), read from its
    ``config.json`` before anything loads; a ValueError for a folder that holds a PEFT adapter instead of a whole
    model, or a model of another head, and FileNotFoundError for one without a model."""
    model_dir = Path(model_dir)
    if (model_dir / ADAPTER_CONFIG).is_file():
        raise ValueError(
            f"{model_dir} holds a LoRA adapter, not a whole model, and an adapter does not export to ONNX: run the "
            "recipe with peft.merge=true, or load the adapter, merge_and_unload() and save_pretrained() the merged "
            "model (docs/lora.md), then export that"
        )
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} holds no model (no config.json)")
    architectures = json.loads(config_path.read_text()).get("architectures") or ["(no architecture named)"]
    return head_of(architectures[0])


def input_names(model: nn.Module, head: OnnxHead, preprocessor=None) -> tuple[str, ...]:
    """The inputs a graph of ``model`` takes: the head's that its ``forward`` has, ``token_type_ids`` only where
    ``preprocessor`` (a tokenizer) makes them."""
    parameters = inspect.signature(model.forward).parameters
    made = getattr(preprocessor, "model_input_names", None) or ()
    return tuple(name for name in head.inputs if name in parameters and (name != "token_type_ids" or name in made))


def example_inputs(
    model: nn.Module, head: OnnxHead, names: Sequence[str], shape: tuple[int, int], seed: int = 0
) -> dict[str, torch.Tensor]:
    """A batch of ``shape`` (batch, tokens) for ``model``: random token ids with every row but the first padded
    (right-padded, or left-padded for a causal LM as ``generate`` pads), position ids counted over the real
    tokens as ``generate`` counts them, zero token types; random images of the config's size."""
    generator = torch.Generator().manual_seed(seed)
    batch, length = shape
    config = model.config
    if not head.text:
        size, channels = config.image_size, config.num_channels
        return {"pixel_values": torch.randn(batch, channels, size, size, generator=generator)}
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        padding = min(2 * row, length - 1)
        mask[row, slice(None, padding) if head.causal else slice(length - padding, None)] = 0
    inputs = {
        "input_ids": torch.randint(0, config.vocab_size, (batch, length), generator=generator),
        "attention_mask": mask,
        "token_type_ids": torch.zeros(batch, length, dtype=torch.long),
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }
    return {name: inputs[name] for name in names}


class _Logits(nn.Module):
    """The traced module: the model's logits from the graph's inputs, in order (a causal LM without cache)."""

    def __init__(self, model: nn.Module, names: Sequence[str], causal: bool) -> None:
        super().__init__()
        self.model, self.names = model, tuple(names)
        self.options = {"use_cache": False} if causal else {}

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, tensors, strict=True)), **self.options).logits


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Without the exporter's notes that are not about the model: that torchvision's operators are not there, that
    the inputs share their dynamic axes' names (as they should), and a deprecation inside torch."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*shares the same shape constraints.*", category=UserWarning)
            yield
    finally:
        registration.setLevel(level)


def _import_exporter() -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise ImportError(f"ONNX export needs the onnx extra: pip install 'ea_hf[onnx]' ({error})") from None


def export_model(
    model: nn.Module, path: str | Path, *, head: OnnxHead | None = None, names: Sequence[str] | None = None
) -> OnnxExport:
    """Write ``model``'s graph (its logits) to ``path`` with dynamic batch and sequence axes (batch only for
    images), traced in eval mode on :data:`TRACE_SHAPE`, then run it in onnxruntime on :data:`CHECK_SHAPE` where
    onnxruntime is installed (:attr:`OnnxExport.max_difference`). Traced with autograd on, as
    ``torch.onnx.export`` traces by default: under ``torch.no_grad()`` the attention reuses spent maps above a size
    (``ea_hf.modeling.map_reuse``), a guard on the batch size that a dynamic batch axis of images cannot take.

    ``head``: as the model's class name says (:func:`head_of`); ``names``: the graph's inputs (default: those of
    :func:`input_names` without a tokenizer)."""
    _import_exporter()
    head = head_of(type(model).__name__) if head is None else head
    names = input_names(model, head) if names is None else tuple(names)
    model.eval()
    wrapper = _Logits(model, names, head.causal).eval()
    axes = {0: torch.export.Dim(BATCH_AXIS)}
    if head.text:
        axes[1] = torch.export.Dim(SEQUENCE_AXIS)
    inputs = example_inputs(model, head, names, TRACE_SHAPE)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.enable_grad(), _quiet_exporter():
        program = torch.onnx.export(
            wrapper,
            tuple(inputs.values()),
            input_names=list(names),
            output_names=["logits"],
            dynamic_shapes=(tuple(axes for _ in names),),
            dynamo=True,
            verbose=False,
        )
    program.save(str(path))
    return OnnxExport(path, head, names, check_against_pytorch(path, wrapper, head, names))


def check_against_pytorch(path: str | Path, wrapper: nn.Module, head: OnnxHead, names: Sequence[str]) -> float | None:
    """The largest difference between onnxruntime's logits of the graph at ``path`` and the module's, on a padded
    batch of :data:`CHECK_SHAPE` (a causal LM's real tokens only); None without onnxruntime."""
    try:
        import onnxruntime
    except ImportError:
        return None
    inputs = example_inputs(wrapper.model, head, names, CHECK_SHAPE, seed=1)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {name: tensor.numpy() for name, tensor in inputs.items()})
    with torch.no_grad():
        expected = wrapper(*inputs.values())
    difference = (torch.from_numpy(logits) - expected).abs()
    if head.causal:
        difference = difference[inputs["attention_mask"].bool()]
    return float(difference.max())


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def export_checkpoint(
    model_dir: str | Path, output_dir: str | Path, *, progress: Callable[[str], None] = _to_stderr
) -> OnnxExport:
    """Export the model saved in ``model_dir`` (a finished run directory or a saved checkpoint) to
    ``output_dir``: ``model.onnx`` (:func:`export_model`, float32), the tokenizer's or image processor's files, and
    the ``config.json`` (and ``generation_config.json`` of a causal LM) of the model's own architecture, which
    loads without ea_hf (the graph holds the evolution). ``progress`` gets a line at each stage (default: stderr).

    Refused with one clear error before anything loads (:func:`check_exportable`): a PEFT adapter that is not
    merged, a head that does not export, a folder without a model, or an ``output_dir`` that holds files."""
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    head = check_exportable(model_dir)
    if output_dir.exists() and any(output_dir.iterdir()):
        raise FileExistsError(f"{output_dir} exists and is not empty; remove it or choose another --output")
    _import_exporter()
    progress(f"loading the {head.task} model in {model_dir}")
    model = getattr(transformers, head.auto_class).from_pretrained(model_dir, dtype=torch.float32)
    loader = transformers.AutoTokenizer if head.text else transformers.AutoImageProcessor
    try:
        preprocessor = loader.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError):
        preprocessor = None
        progress(f"{model_dir} has no {'tokenizer' if head.text else 'image processor'}; exporting the model alone")
    names = input_names(model, head, preprocessor)
    axes = f"{BATCH_AXIS} and {SEQUENCE_AXIS}" if head.text else BATCH_AXIS
    evolving = "an EA model" if is_patched(model) else "a model without evolving attention"
    progress(f"exporting {type(model).__name__} ({evolving}) to ONNX: inputs {', '.join(names)}; dynamic {axes} axes")
    exported = export_model(model, output_dir / ONNX_FILE, head=head, names=names)
    if exported.max_difference is None:
        progress("onnxruntime is not installed: the graph was not run (pip install onnxruntime to check it)")
    else:
        shape = " x ".join(map(str, CHECK_SHAPE)) if head.text else str(CHECK_SHAPE[0])
        progress(
            f"checked: onnxruntime's logits match PyTorch's within {exported.max_difference:.2g} on a padded "
            f"batch of {shape} (another shape than the traced one)"
        )
    if preprocessor is not None:
        preprocessor.save_pretrained(output_dir)
    plain = unpatch(model) if is_patched(model) else model
    plain.config.architectures = [type(plain).__name__]
    plain.config.save_pretrained(output_dir)
    if head.causal and plain.can_generate():
        plain.generation_config.save_pretrained(output_dir)
    return exported
