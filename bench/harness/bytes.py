"""The bytes one step moves, counted op by op on the ``meta`` device: no compute, no CPU kernel, the path CUDA takes.

Every aten op of the step counts the bytes of its tensor inputs and outputs (:class:`ByteCounter`), as a GPU kernel
that reads each input once and writes each output once moves them:

- views (ops whose outputs alias an input: ``view``, ``transpose``, ``expand``, matmul's ``_unsafe_view``) move
  nothing and are left out;
- an argument an op writes in place (``add_``'s self) counts as read and written; an ``out=`` argument, and the
  argument of ops that only write theirs (``copy_``, ``fill_``, ``zero_``, ``bernoulli_`` ...), as written; ops
  that take a tensor for its shape and dtype (``new_zeros``, ``zeros_like`` ...) only their output;
- allocations (``empty``, ``new_empty``, ``empty_like`` ...) move nothing;
- a broadcast input (stride 0 along a dimension) counts the elements it holds, not the ones it stands for;
- ``embedding`` reads the rows it looks up, not the whole table;
- a fused kernel's torch operator (``torch.ops.ea_hf.triton_*``) counts what its kernels read and write, declared
  beside its fake implementation (``ea_hf.ops.triton.operators.DECLARED_BYTES``); an operator without a
  declaration counts its inputs and outputs like an aten op.

The meta device takes the choices ea_hf makes for CUDA tensors: every branch on ``device.type == "cpu"`` (the CPU
kernel, the fused masked passes, the weight gradient by taps) goes the GPU way, and for autocast ``meta`` stands for
``cuda`` (:func:`meta_autocast`). The EA candidates are the variants of ``attention_gpu.py``: ``ea-torch`` (torch
operations), ``ea-triton`` (the Triton kernels and fused attention tail, counted through
their operators on meta: :func:`triton_on_meta`) and ``ea-torch-nhwc`` (torch operations with the convolutions on
channels-last maps whose heads are padded to a multiple of 8, ``EA_HF_CHANNELS_LAST=1``: the padding and the
layout's copies counted with the rest). ea_hf's default on CUDA is one of them, per GPU and precision
(:func:`default_variant`: on an H100 or H200, ``ea-triton`` for bf16 and fp16 maps). Compiled variants are not
counted: inductor fuses and plans its own buffers, which the meta device cannot show.

The public API: :func:`count_bytes` (any callable), :func:`count_step_bytes` (a model's step by mode),
:func:`count_case` (one :class:`ByteCase` of :data:`CASES` for one variant), :func:`byte_table` (a Markdown table of
counted cases) and :class:`ByteCount` (the total, and bytes and calls per op).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from harness.ea import EA_ALPHA, EA_BETA, attributes, environment, import_ea_hf
from harness.models import BERT_BASE_CONFIG, LLAMA_125M_CONFIG
from harness.tables import markdown_table

#: The variants counted: eager attention and the EA candidates of attention_gpu.py's decision table that run uncompiled.
VARIANTS = ("eager", "ea-torch", "ea-triton", "ea-torch-nhwc")
#: What a step does: BERT's training step and forward; a decoder's prefill and one decoding step with the cache.
MODES = ("training", "inference", "prefill", "decode")
#: Ops that allocate without writing: they move nothing.
ALLOCATIONS = frozenset({"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"})
#: Ops that take a tensor for its shape, dtype or device only: its elements are not read, their output is written.
SHAPE_ONLY = frozenset(
    {"new_zeros", "new_full", "new_ones", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like"}
    | {"randint_like"}
)
#: Ops that write an argument without reading it: the written argument counts once.
WRITE_ONLY = frozenset(
    {"copy_", "fill_", "zero_", "bernoulli_", "normal_", "uniform_", "random_", "exponential_", "set_"}
)


@dataclasses.dataclass
class ByteCount:
    """The bytes a counted call moved: ``by_op`` (op name -> bytes read plus written) and ``calls`` (op name -> calls).

    Example:
        >>> count = ByteCount({"mm": 3_000_000_000, "add": 1_000_000_000}, {"mm": 2, "add": 1})
        >>> count.total, count.gigabytes, count.largest(1)
        (4000000000, 4.0, [('mm', 3000000000)])
    """

    by_op: dict[str, int] = dataclasses.field(default_factory=dict)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        """All ops' bytes."""
        return sum(self.by_op.values())

    @property
    def gigabytes(self) -> float:
        """:attr:`total` in GB (10^9 bytes)."""
        return self.total / 1e9

    def largest(self, count: int = 5) -> list[tuple[str, int]]:
        """The ``count`` ops that moved the most bytes, largest first."""
        return sorted(self.by_op.items(), key=lambda item: -item[1])[:count]

    def as_dict(self) -> dict[str, Any]:
        """The count as JSON: total, per op (largest first) and calls."""
        return {"bytes": self.total, "by_op": dict(self.largest(len(self.by_op))), "calls": self.calls}


def held_bytes(tensor: Any) -> int:
    """The bytes of the elements ``tensor`` holds: a broadcast dimension (stride 0) counts once.

    Example:
        >>> import torch
        >>> held_bytes(torch.empty(2, 3)), held_bytes(torch.empty(3).expand(4, 3))
        (24, 12)
    """
    elements = math.prod(size for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride != 0)
    return elements * tensor.element_size() if tensor.numel() else 0


def _tensors(value: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_flatten

    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def _declared_bytes() -> dict[str, Callable[..., int]]:
    import_ea_hf()
    from ea_hf.ops.triton.operators import DECLARED_BYTES

    return DECLARED_BYTES


def op_bytes(func: Any, args: tuple, kwargs: dict, output: Any, declared: dict[str, Callable[..., int]]) -> int | None:
    """The bytes ``func`` moved on ``args`` and ``kwargs`` giving ``output`` by the rules of the module docstring;
    None for a view or an allocation."""
    schema = func._schema
    if func.__name__.split(".")[0] in {"_unsafe_view", *ALLOCATIONS} or any(
        ret.alias_info is not None and not ret.alias_info.is_write for ret in schema.returns
    ):
        return None
    if schema.name in declared:
        return declared[schema.name](*args, **kwargs)
    if schema.name == "aten::embedding":  # the rows looked up, not the whole table
        return 2 * held_bytes(output) + held_bytes(args[1])
    name = func.__name__.split(".")[0]
    if name in SHAPE_ONLY:
        return sum(held_bytes(t) for t in _tensors(output))
    values = list(args) + [kwargs.get(argument.name) for argument in schema.arguments[len(args) :]]
    write_only = name in WRITE_ONLY
    moved = 0
    for argument, value in zip(schema.arguments, values, strict=False):
        written = argument.alias_info is not None and argument.alias_info.is_write
        read_and_written = written and not write_only and not argument.kwarg_only  # out= is only written
        moved += sum(held_bytes(t) * (2 if read_and_written else 1) for t in _tensors(value))
    if not any(ret.alias_info is not None for ret in schema.returns):  # in place or out=: counted as arguments
        moved += sum(held_bytes(t) for t in _tensors(output))
    return moved


def byte_counter_mode() -> Any:
    """A :class:`torch.utils._python_dispatch.TorchDispatchMode` that adds up :func:`op_bytes` per op in its
    ``count`` (a :class:`ByteCount`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    declared = _declared_bytes()

    class ByteCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: Counter = Counter()
            self.calls: Counter = Counter()

        @property
        def count(self) -> ByteCount:
            return ByteCount(dict(self.bytes), dict(self.calls))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            output = func(*args, **kwargs)
            moved = op_bytes(func, args, kwargs, output, declared)
            if moved is not None:
                name = func._schema.name.removeprefix("aten::").replace("::", ".")
                self.bytes[name] += moved
                self.calls[name] += 1
            return output

    return ByteCounter()


@contextlib.contextmanager
def meta_autocast() -> Iterator[None]:
    """``torch.autocast``, ``torch.is_autocast_enabled`` and ``torch.get_autocast_dtype`` taking ``meta`` for
    ``cuda`` for the duration (meta has no autocast of its own), so that code asking about its tensors' device
    type runs as on CUDA."""
    import torch

    def as_cuda(device_type: Any) -> Any:
        return "cuda" if device_type == "meta" else device_type

    original_autocast, enabled, dtype = torch.autocast, torch.is_autocast_enabled, torch.get_autocast_dtype

    class MetaAutocast(original_autocast):
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__(as_cuda(device_type), *args, **kwargs)

    replaced = {
        "autocast": MetaAutocast,
        "is_autocast_enabled": lambda *device: enabled(*map(as_cuda, device)),
        "get_autocast_dtype": lambda device: dtype(as_cuda(device)),
    }
    with attributes(torch, replaced):
        yield


@contextlib.contextmanager
def triton_on_meta() -> Iterator[None]:
    """ea_hf's Triton kernels taking meta tensors for the duration, through their torch operators (whose fake
    implementations run on meta, and whose bytes are declared): ``EA_HF_TRITON=1``, each ``applicable`` judged on
    CPU stand-ins of the tensors under the interpreter's rules, and the entry points routed to the operators as
    while torch.compile traces. Only for counting: the numbers are meta's."""
    import torch

    import_ea_hf()
    from ea_hf.modeling.convolution import plus_addend
    from ea_hf.ops.fused_step import schema_arguments
    from ea_hf.ops.triton import attention_tail, evolution

    def stand_in(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            return torch.empty((), dtype=value.dtype).expand(value.shape)
        return value

    def on_cpu_stand_ins(applicable: Callable[..., bool]) -> Callable[..., bool]:
        def judged(*args: Any, **kwargs: Any) -> bool:
            return applicable(*map(stand_in, args), **{k: stand_in(v) for k, v in kwargs.items()})

        return judged

    def evolve(step, maps, weight, bias, *, in_place, gate=None):
        logits, saved = torch.ops.ea_hf.triton_evolve_with_gate_bits(*maps, weight, bias, *schema_arguments(step))
        return logits, saved if (not in_place if gate is None else gate) else None

    def backward(step, maps, grad, gate, weight, *, shared_map=False):
        incoming = plus_addend(grad.grad, grad.addend, owned=grad.spent)  # as the kernels' backward_pass adds it
        return evolution.backward_through_operator(step, maps, incoming, gate, weight)

    def convolve(x, weight, bias, *, row_shift):
        return torch.ops.ea_hf.triton_convolve(x, weight, bias, row_shift)

    def tail_forward(logits, allowed, additive, value, dropout_keep=None, dropout_scale=1.0):
        return torch.ops.ea_hf.triton_attention_tail(logits, allowed, additive, value, dropout_keep, dropout_scale)

    def tail_backward(logits, allowed, additive, value, keep, scale, stats, grad_output, grad_dtype, addend=None):
        operator = torch.ops.ea_hf.triton_attention_tail_backward
        grad_logits, grad_value = operator(logits, allowed, additive, value, keep, scale, stats, grad_output, addend)
        return grad_logits if grad_logits.dtype == grad_dtype else grad_logits.to(grad_dtype), grad_value

    kernels = {
        "applicable": on_cpu_stand_ins(evolution.applicable),
        "evolve": evolve,
        "backward": backward,
        "convolve": convolve,
    }
    tail = {"applicable": on_cpu_stand_ins(attention_tail.applicable), "forward": tail_forward}
    tail["backward"] = tail_backward
    variables = {"EA_HF_TRITON": "1", "TRITON_INTERPRET": "1"}
    with environment(variables), attributes(evolution, kernels), attributes(attention_tail, tail):
        yield


@contextlib.contextmanager
def variant_path(variant: str) -> Iterator[None]:
    """The environment of ``variant``'s path: Triton on meta for ``ea-triton``; torch operations otherwise (the
    CPU kernel off, which never takes meta tensors anyway)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {VARIANTS}")
    channels_last = "1" if variant == "ea-torch-nhwc" else "0"  # the torch path's channels-last candidate
    with environment({"EA_HF_KERNELS": "0", "EA_HF_TRITON": "0", "EA_HF_CHANNELS_LAST": channels_last}):
        if variant == "ea-triton":
            with triton_on_meta():
                yield
        else:
            yield


def count_bytes(call: Callable[[], Any]) -> ByteCount:
    """The bytes ``call`` moves, op by op (its tensors on meta; see the module docstring).

    Example:
        >>> import torch
        >>> x = torch.empty(1000, device="meta")
        >>> count_bytes(lambda: x.mul(2).add_(1)).by_op  # mul: read 4000, write 4000; add_: read and write 4000
        {'mul': 8000, 'add_': 8000}
    """
    with meta_autocast(), byte_counter_mode() as counter:
        call()
    return counter.count


def count_step_bytes(build_model: Callable[[], Any], inputs: dict[str, Any], mode: str) -> ByteCount:
    """The bytes of one step of the model ``build_model()`` gives (on meta) on ``inputs`` (meta tensors), by ``mode``:
    ``training`` (forward, ``last_hidden_state.float().pow(2).mean()``, backward; no optimizer step),
    ``inference`` (forward under ``no_grad``), ``prefill`` (forward with a cache, under ``no_grad``) and ``decode``
    (one token's forward on the cache a prefill of ``inputs`` left, the prefill not counted)."""
    import torch

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    model = build_model()
    model.train(mode == "training")

    if mode == "training":

        def step() -> None:
            model(**inputs).last_hidden_state.float().pow(2).mean().backward()

        return count_bytes(step)
    with torch.no_grad(), meta_autocast():
        if mode == "inference":
            return count_bytes(lambda: model(**inputs))
        if mode == "prefill":
            return count_bytes(lambda: model(**inputs, use_cache=True))
        cache = model(**inputs, use_cache=True).past_key_values
        next_token = inputs["input_ids"][:, -1:]
        return count_bytes(lambda: model(input_ids=next_token, past_key_values=cache, use_cache=True))


@dataclasses.dataclass(frozen=True)
class ByteCase:
    """One counted case: ``model`` (``bert``: BERT-Base; ``llama``: the decoder benchmarks' ~125M Llama), ``mode``
    (:data:`MODES`), sequence ``length``, ``batch``, ``dtype`` (torch's name) and ``dropout`` (BERT's dropout
    probabilities; 0 as in the benchmarks)."""

    model: str
    mode: str
    length: int
    batch: int
    dtype: str = "bfloat16"
    dropout: float = 0.0

    @property
    def name(self) -> str:
        """A label: model, mode, N and batch."""
        return f"{self.model} {self.mode} N={self.length} batch {self.batch}"


#: The cases of the byte table (issue 72): BERT-Base training and inference at N = 512 batch 8, training at
#: N = 2048 batch 2; the Llama's prefill at N = 512 and 2048 and a decoding step on a cache of 2048.
CASES = (
    ByteCase("bert", "training", 512, 8),
    ByteCase("bert", "inference", 512, 8),
    ByteCase("bert", "training", 2048, 2),
    ByteCase("llama", "prefill", 512, 1),
    ByteCase("llama", "prefill", 2048, 1),
    ByteCase("llama", "decode", 2048, 1),
)

#: Issue 72's targets: EA's bytes over eager's on ea_hf's default path on CUDA (:func:`default_variant`), at most.
TARGETS = {
    ByteCase("bert", "training", 512, 8): 1.25,
    ByteCase("bert", "inference", 512, 8): 1.25,
    ByteCase("bert", "training", 2048, 2): 1.35,
    ByteCase("llama", "decode", 2048, 1): 1.15,
}
#: The GPU whose default the table's "default" columns follow: compute capability 9 (an H100 or H200), the GPU of
#: the committed decision table (``bench/results/nvidia-h200/decision_table.json``).
DEFAULT_GPU_CAPABILITY = 9


def default_variant(case: ByteCase) -> str:
    """The EA variant that ea_hf's default takes for ``case``'s maps on a CUDA GPU of :data:`DEFAULT_GPU_CAPABILITY`
    without ``EA_HF_TRITON`` set (``ea_hf.ops.triton.common.TRITON_BY_DEFAULT``).

    Example:
        >>> bf16, fp32 = ByteCase("bert", "training", 512, 8), ByteCase("bert", "training", 512, 8, "float32")
        >>> default_variant(bf16), default_variant(fp32)
        ('ea-triton', 'ea-torch')
    """
    import torch

    import_ea_hf()
    from ea_hf.ops.triton.common import TRITON_BY_DEFAULT, precision

    key = (DEFAULT_GPU_CAPABILITY, precision(getattr(torch, case.dtype)))
    return "ea-triton" if key in TRITON_BY_DEFAULT else "ea-torch"


#: BERT-Base as attention_gpu.py builds it, and the decoder benchmarks' ~125M Llama (12 query and 4 key/value heads).
BERT_CONFIG, LLAMA_CONFIG = BERT_BASE_CONFIG, LLAMA_125M_CONFIG


def case_model(case: ByteCase, variant: str, config: dict[str, Any] | None = None) -> Any:
    """``case``'s model for ``variant`` on meta in its dtype: eager attention, or EA (``ea_hf.patch`` with
    EA_ALPHA and EA_BETA on every layer). ``config`` overrides the model's configuration (smaller test models)."""
    import torch
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

    if case.model == "bert":
        settings = {**BERT_CONFIG, "hidden_dropout_prob": case.dropout, "attention_probs_dropout_prob": case.dropout}
        model_class, config_class = BertModel, BertConfig
    else:
        settings, model_class, config_class = {**LLAMA_CONFIG, "attention_dropout": 0.0}, LlamaModel, LlamaConfig
    with torch.device("meta"):
        model = model_class(config_class(**{**settings, **(config or {})}))
    model.set_attn_implementation("eager")
    if variant != "eager":
        import_ea_hf().patch(model, alpha=EA_ALPHA, beta=EA_BETA)
    return model.to(dtype=getattr(torch, case.dtype))


def count_case(case: ByteCase, variant: str, config: dict[str, Any] | None = None) -> ByteCount:
    """The bytes of ``case``'s step for ``variant`` (:data:`VARIANTS`). Token ids on meta and no attention mask
    (what transformers passes for an all-ones mask)."""
    import torch

    input_ids = torch.zeros(case.batch, case.length, dtype=torch.long, device="meta")
    with variant_path(variant):
        return count_step_bytes(lambda: case_model(case, variant, config), {"input_ids": input_ids}, case.mode)


def count_cases(cases: tuple[ByteCase, ...] = CASES, variants: tuple[str, ...] = VARIANTS) -> list[dict[str, Any]]:
    """Every case counted for every variant: one dict per case with its settings and each variant's
    :meth:`ByteCount.as_dict`."""
    rows = []
    for case in cases:
        counts = {variant: count_case(case, variant).as_dict() for variant in variants}
        rows.append({**dataclasses.asdict(case), "name": case.name, "variants": counts})
    return rows


def byte_table(rows: list[dict[str, Any]], variants: tuple[str, ...] = VARIANTS) -> str:
    """A Markdown table of :func:`count_cases`' rows: GB per variant, each EA variant's ratio to eager, the variant
    ea_hf's default takes on the table's GPU (:func:`default_variant`) with its ratio against the case's target
    (:data:`TARGETS`), and that variant's largest op."""
    ea_variants = [v for v in variants if v != "eager"]
    header = ["case", *(f"{v} GB" for v in variants), *(f"{v} / eager" for v in ea_variants)]
    header += ["default on CUDA", "default / eager (target)", "largest op of the default"]
    lines = []
    for row in rows:
        case = ByteCase(**{field.name: row[field.name] for field in dataclasses.fields(ByteCase)})
        counted = row["variants"]
        eager = counted["eager"]["bytes"] if "eager" in counted else None
        cells = [row["name"], *(f"{counted[v]['bytes'] / 1e9:.2f}" for v in variants)]
        cells += [f"{counted[v]['bytes'] / eager:.2f}x" if eager else "-" for v in ea_variants]
        default = default_variant(case)
        if default in counted and eager:
            ratio, target = counted[default]["bytes"] / eager, TARGETS.get(case)
            verdict = "" if target is None else f" (<= {target}: {'pass' if ratio <= target else 'FAIL'})"
            op, moved = next(iter(counted[default]["by_op"].items()))
            cells += [f"`{default}`", f"{ratio:.2f}x{verdict}", f"`{op}` {moved / 1e9:.2f} GB"]
        else:
            cells += [f"`{default}`", "not counted", "-"]
        lines.append(cells)
    return markdown_table(header, "l" + "r" * (len(header) - 4) + "lll", lines)


def environment_variables() -> dict[str, str | None]:
    """The environment variables that pick ea_hf's paths, as they are now (recorded beside a table)."""
    names = ("EA_HF_KERNELS", "EA_HF_TRITON", "EA_HF_CHANNELS_LAST", "TRITON_INTERPRET")
    return {name: os.environ.get(name) for name in names}
