"""Fast generation (bench/benchmarks/decoder_static.py) in its dry run on the CPU: a static cache, each attention
decoding as it is and compiled (dynamo's graphs run by the eager backend), held against plain and the targets."""

import json

import pytest
from testing import bench_script

DECODE_TOKENS = 3


bench = bench_script("benchmarks/decoder_static")


@pytest.fixture(scope="module")
def static_report(tmp_path_factory):
    """A tiny run on the CPU, dynamo's graphs run as they are (the eager backend: inductor would take
    minutes here), each N's paired timing in this process."""
    out = tmp_path_factory.mktemp("bench_decoder_static")
    args = bench.parse_args(
        ["--device", "cpu", "--tiny", "--compile-backend", "eager", "--out", str(out), "--lengths", "16"]
        + ["--threads", "1", "--decode-tokens", str(DECODE_TOKENS), "--paired-rounds", "2"]
    )
    return bench.RUN.collect(args, paired_run=bench.run_static_paired), out


def test_static_decoding_compiles_one_graph_and_decodes_the_same_tokens(static_report):
    """Every attention as it is and compiled, over three new caches (a warm-up round and two timed): one graph
    each, no recompilation between steps or caches, and the same greedy tokens as uncompiled."""
    result, _ = static_report
    (timing,) = result["paired_timing"]
    variants = ["eager", "eager-compile", "sdpa", "sdpa-compile", "ea", "ea-compile"]
    assert list(timing["prefill_times_s"]) == variants
    for variant in variants:
        prefills, steps = timing["prefill_times_s"][variant], timing["decode_times_s"][variant]
        assert len(prefills) == 2 and len(steps) == 2 * DECODE_TOKENS and min(prefills + steps) > 0
        assert timing["graphs_compiled"][variant] == (1 if variant.endswith("-compile") else 0)
        assert timing["cache_length_after_decode"][variant] == 16 + DECODE_TOKENS
    tokens = timing["decoded_tokens"]
    for attention in bench.ATTENTIONS:
        assert tokens[f"{attention}-compile"] == tokens[attention] and len(tokens[attention]) == DECODE_TOKENS
    # The static cache's kept rows: one row per head over the whole cache plus the convolution's k // 2 columns.
    heads, layers = result["config"]["num_attention_heads"], result["config"]["num_hidden_layers"]
    kept = timing["kept_rows_after_prefill"]["ea-compile"]
    assert len(kept) == layers and {tuple(r["shape"]) for r in kept.values()} == {(1, heads, 1, 16 + DECODE_TOKENS + 1)}
    assert timing["evolution_path"]["sdpa-compile"] is None and timing["evolution_path"]["ea"] is not None


def test_static_decoding_is_held_against_plain_run_alike_and_the_targets(static_report):
    result, out = static_report
    (timing,) = result["paired_timing"]
    decode, prefill = timing["decode_median_s"], timing["prefill_median_s"]
    rows = {r["variant"]: r for r in result["comparison"]}
    assert rows["ea-compile"]["decode_over_plain"] == pytest.approx(decode["ea-compile"] / decode["sdpa-compile"])
    assert rows["ea"]["decode_over_plain"] == pytest.approx(decode["ea"] / decode["sdpa"])
    assert rows["ea-compile"]["decode_over_as_is"] == pytest.approx(decode["ea-compile"] / decode["ea"])
    assert rows["sdpa-compile"]["decode_over_plain"] == rows["sdpa"]["decode_over_plain"] == 1.0
    assert all(row["same_tokens_as_is"] for row in rows.values())
    targets = {(t["what"], t["variant"]): t for t in result["targets"]}
    assert set(targets) == set(bench.TARGETS)
    assert targets[("prefill", "ea")]["ratio"] == pytest.approx(prefill["ea"] / prefill["sdpa"])
    assert targets[("decode", "ea-compile")]["met"] is (rows["ea-compile"]["decode_over_plain"] <= 1.10)
    data = json.loads((out / "bench_decoder_static_dry_run_tiny.json").read_text())
    assert data["settings"]["compile_backend"] == "eager" and data["comparison"] == result["comparison"]
    markdown = (out / "bench_decoder_static_dry_run_tiny.md").read_text()
    assert 'backend="eager"' in markdown and markdown.count("(target <= ") == 2
    assert sum(line.startswith("| ea-compile | 16 | ") for line in markdown.splitlines()) == 1


def test_static_arguments():
    args = bench.parse_args(["--lengths", "512"])
    assert (args.device, args.compile_mode, args.compile_backend, args.dtype, args.attentions) == (
        "cuda", "reduce-overhead", "inductor", "bf16", ["eager", "sdpa", "ea"]
    )  # fmt: skip
    assert bench.RUN.output_paths(args, "NVIDIA H200")[0].name == "bench_decoder_static.json"
    with pytest.raises(SystemExit):
        bench.parse_args(["--attentions", "eager", "ea"])  # no plain model to hold EA against
