"""The roofline of one layer's evolution step on a GPU: the bytes it must move and the FLOPs it must do, from the
shapes, against what the kernels measured (``triton_kernels.py``) and what the targets allow
(``attention_gpu.py``'s eager step).

    python bench/analyses/roofline.py    # the table of docs/performance.md, from bench/results/nvidia-h200/

A fused evolution step reads S and A_prev and writes A_logit and the ReLU gate (bit-packed: an eighth of a byte
an element, as the fused kernels keep it) in its forward pass; its backward reads the incoming gradient (and the
next layer's, added as it reads), the gate (twice: the input and the weight gradients), S and A_prev, and writes
the gradients of S and A_prev: ten maps in the model's dtype and three reads or writes of the packed gate a
layer, forward and backward. The 3x3 convolution over H heads is 2 * 9 * H FLOPs per element and pass (three
passes: the forward, the input gradient and the weight gradient). At these shapes the step is bandwidth-bound on
both GPUs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # harness/ is in bench/, one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import RESULTS_DIR  # noqa: E402
from harness.models import DTYPE_BYTES  # noqa: E402
from harness.traffic import Gpu, Traffic, evolution_traffic  # noqa: E402

RESULTS = RESULTS_DIR / "nvidia-h200"


#: SXM parts. fp32 maps multiply as TF32 on tensor cores (cuDNN's and the kernels' default).
H100 = Gpu("H100 SXM", 3.35e12, {"bf16": 989e12, "fp32": 495e12})
H200 = Gpu("H200 SXM", 4.8e12, {"bf16": 989e12, "fp32": 495e12})


def eager_traffic(batch: int, heads: int, n: int, dtype: str, head_dim: int = 64) -> Traffic:
    """The least that unfused eager attention moves per layer over its maps: S written and read, P written and
    read by the product with V (forward); P and the gradient of P read, the gradient of S written and read by
    the products for Q and K (backward); and its products' FLOPs (QK^T and PV, then four products backward).

    Example:
        >>> round(eager_traffic(8, 12, 512, "bf16").forward_bytes / 1e6)  # MB
        201
    """
    elements = batch * heads * n * n
    size = DTYPE_BYTES[dtype]
    products = 2 * 2 * head_dim * elements
    return Traffic(4 * size * elements, 6 * size * elements, products, 2 * products)


def tail_traffic(batch: int, heads: int, n: int, dtype: str, fused: bool, head_dim: int = 64) -> Traffic:
    """What the attention tail after the evolution moves and computes per layer, with attention dropout (as
    BERT trains): the masked softmax over A_logit, dropout and the product with V, forward and backward.

    On torch operations (the core's path, every map in the logits' dtype): forward, A_logit read and P written,
    dropout's mask drawn and applied, dropout(P) read by the product; backward, P recomputed, dropout applied
    again and read by the product for dV, dO @ V^T written, dropout's gradient, the softmax's gradient (P and G
    read, written over G). Fused (ea_hf's Triton attention tail): forward, A_logit read and dropout's mask drawn
    (by torch) and read; backward, A_logit and the mask read twice (the row terms' pass, then the gradients' one),
    the next layer's gradient of A_logit read and A_logit's gradient, with it added, written. The products: P @ V
    forward, dV and dP backward and dP again for the row terms, 2 * head_dim FLOPs an element each.

    Example:
        >>> [round(tail_traffic(8, 12, 512, "bf16", fused).backward_bytes / 1e6) for fused in (False, True)]  # MB
        [604, 252]
    """
    elements = batch * heads * n * n
    size = DTYPE_BYTES[dtype]
    product = 2 * head_dim * elements
    if fused:
        forward = size + 1 + 1
        backward = (size + 1) * 2 + 2 * size
        return Traffic(forward * elements, backward * elements, product, 3 * product)
    forward = size + size + (1 + 2 * size) + size
    backward = (size + size) + (2 * size + 1) + size + size + (2 * size + 1) + 3 * size
    return Traffic(forward * elements, backward * elements, product, 2 * product)


def measured(results: Path = RESULTS) -> tuple[dict, dict]:
    """(the kernel cases of triton_kernels.json, the eager steps of bench_gpu.json), keyed by dtype (and mode)."""
    kernels = json.loads((results / "triton_kernels.json").read_text())
    model = json.loads((results / "bench_gpu.json").read_text())
    cases = {case["dtype"]: dict(case) for case in kernels["cases"] if not case["causal"]}
    for dtype, case in cases.items():  # the fastest forward of the tile sweep
        swept = [entry["forward_ms"] for entry in kernels["sweep"] if entry["dtype"] == dtype and "forward_ms" in entry]
        case["swept_forward_ms"] = min(swept, default=float("nan"))
    eager = {
        (case["dtype"], case["mode"]): case["median_s"]
        for case in model["cases"]
        if case["variant"] == "eager" and case["status"] == "ok"
    }
    return cases, eager


def roofline_table(gpu: Gpu = H200, results: Path = RESULTS, layers: int = 12, target: float = 1.15) -> str:
    """Per layer of BERT-Base (12 heads, N = 512, batch 8): the step's least bytes and its FLOPs, its roofline
    time, the time the kernels measured and the share of the roofline that is (the fraction of peak bandwidth
    they reach), and the time a layer may add for a training step within ``target`` x eager's."""
    cases, eager = measured(results)
    lines = [
        "| maps | pass | least bytes | GFLOP | roofline | Triton | torch ops | Triton / torch at roofline |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for dtype in ("bf16", "fp32"):
        case = cases[dtype]
        eager_maps = eager_traffic(case["batch"], case["heads"], case["n"], dtype)
        lines.append(
            f"| {dtype} | eager attention's maps, forward + backward "
            f"| {(eager_maps.forward_bytes + eager_maps.backward_bytes) / 1e6:.0f} MB "
            f"| {(eager_maps.forward_flops + eager_maps.backward_flops) / 1e9:.1f} "
            f"| {eager_maps.seconds(gpu, dtype) * 1e6:.0f} us | | | |"
        )
        for fused, path in ((False, "torch ops"), (True, "fused, Triton")):
            tail = tail_traffic(case["batch"], case["heads"], case["n"], dtype, fused)
            lines.append(
                f"| {dtype} | attention tail ({path}), forward + backward "
                f"| {(tail.forward_bytes + tail.backward_bytes) / 1e6:.0f} MB "
                f"| {(tail.forward_flops + tail.backward_flops) / 1e9:.1f} | {tail.seconds(gpu, dtype) * 1e6:.0f} us "
                "| | | |"
            )
        traffic = evolution_traffic(case["batch"], case["heads"], case["n"], dtype)
        for passes, key, total_bytes, flops in (
            ("forward", "forward_ms", traffic.forward_bytes, traffic.forward_flops),
            ("both", "forward_backward_ms", traffic.forward_bytes + traffic.backward_bytes,
             traffic.forward_flops + traffic.backward_flops),
        ):  # fmt: skip
            ideal = traffic.seconds(gpu, dtype, passes) * 1e3
            triton, torch_ops = case[f"triton_{key}"], case[f"torch_{key}"]
            lines.append(
                f"| {dtype} | evolution, {'forward' if passes == 'forward' else 'forward + backward'} "
                f"| {total_bytes / 1e6:.0f} MB | {flops / 1e9:.1f} | {ideal * 1e3:.0f} us | {triton:.2f} ms "
                f"| {torch_ops:.2f} ms | {ideal / triton:.1%} / {ideal / torch_ops:.1%} |"
            )
    budget = {dtype: (target - 1.0) * eager[(dtype, "training")] / layers * 1e3 for dtype in ("bf16", "fp32")}
    lines.append("")
    lines.append(
        f"Within {target}x eager's training step ({eager[('bf16', 'training')] * 1e3:.1f} ms in bf16, "
        f"{eager[('fp32', 'training')] * 1e3:.1f} ms in fp32, 12 layers), EA may add {budget['bf16'] * 1e3:.0f} us "
        f"a layer in bf16 and {budget['fp32'] * 1e3:.0f} us in fp32: the step's forward and backward must reach "
        + " and ".join(
            f"{required(dtype, gpu, budget[dtype], cases):.0%} of the roofline in {dtype}" for dtype in ("bf16", "fp32")
        )
        + ", with nothing else added (the recomputed S and P of the core cost more). The fp32 Triton times are"
        f" from before the fp32 tiles were swept (forward {cases['fp32']['swept_forward_ms']:.2f} ms after it)."
    )
    return "\n".join(lines)


def required(dtype: str, gpu: Gpu, budget_ms: float, cases: dict) -> float:
    """The share of its roofline that a layer's evolution step must reach to fit ``budget_ms``."""
    case = cases[dtype]
    traffic = evolution_traffic(case["batch"], case["heads"], case["n"], dtype)
    return traffic.seconds(gpu, dtype) * 1e3 / budget_ms


if __name__ == "__main__":
    print(roofline_table())
