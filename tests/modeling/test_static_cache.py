"""Fast generation: ``generate(..., cache_implementation="static")`` of EA decoders under
``torch.compile(fullgraph=True)``, as transformers documents it (``model.forward = torch.compile(model.forward,
fullgraph=True)``) and as ``generate`` compiles on its own (``generation_config.compile_config``).

Every decoder-only family of the table is traced with the ``eager`` backend (dynamo's graphs run as they are:
seconds, where inductor takes a minute on these CPUs): one graph for the prefill and one for every decoding step
(no recompilation between steps; unpatched, every family of the table compiles into two as well), and the same
tokens as eager EA with the logits and scores within 1e-5. Inductor compiles Gemma 2 (full and sliding-window
layers, soft-capping; prefill and decoding) and, through generate's own compilation, Llama's decoding step. The
kept rows of a static cache live in buffers allocated once (``history.StaticConvolutionHistory``).
"""

import pytest
import torch
import transformers
from testing import CAUSAL_LM_FAMILIES, causal_lm, generate, left_padded_inputs, table

import ea_hf
from ea_hf.modeling.architectures import release
from ea_hf.modeling.history import CACHE_ATTRIBUTE, StaticConvolutionHistory

FAMILIES = list(CAUSAL_LM_FAMILIES)
EVOLVED = {"alpha": 0.3, "beta": 0.3}
TOLERANCE = 1e-5
#: New tokens: the prefill, then decoding steps enough to show that none recompiles.
NEW_TOKENS = 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def skip_unsupported(family: str) -> None:
    if family == "llama4_text" and release(transformers.__version__) < release("5.20.0"):
        pytest.skip("before transformers 5.20 Llama 4 cannot generate with a static cache, patched or not")


def evolved_lm(family: str, **overrides):
    return ea_hf.patch(causal_lm(family, **overrides), **EVOLVED)


class GraphCounter:
    """A torch.compile backend that counts the graphs it is given and hands them to ``backend``."""

    def __init__(self, backend: str = "eager"):
        self.backend = torch._dynamo.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return self.backend(graph, example_inputs)

    def __deepcopy__(self, memo):  # generate copies its compile_config: the copy counts here too
        return self


def static_generation(model, inputs, **kwargs):
    """``generate`` (greedy; see testing.generate) of NEW_TOKENS tokens with the static cache unless told another."""
    settings = {"cache_implementation": "static", "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    return generate(model, inputs, **settings | kwargs)


def compiled_generation(model, inputs, backend: str = "eager", **kwargs):
    """(generate's output, graphs compiled) with ``model.forward`` compiled with ``fullgraph=True``."""
    counter = GraphCounter(backend)
    model.forward = torch.compile(model.forward, fullgraph=True, backend=counter)
    try:
        with torch.no_grad():
            return static_generation(model, inputs, **kwargs), counter.graphs
    finally:
        del model.forward  # the class's forward again


def assert_same_generation(got, expected, tolerance: float = TOLERANCE) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    for name in ("logits", "scores"):  # scores: -inf where a token is banned, in both
        for a, b in zip(getattr(got, name), getattr(expected, name), strict=True):
            torch.testing.assert_close(a, b, atol=tolerance, rtol=0)


def assert_two_graphs_with_eager_tokens(model) -> None:
    """fullgraph compiles a prefill graph and a decoding graph, and generates eager EA's tokens."""
    inputs = left_padded_inputs()
    with torch.no_grad():
        expected = static_generation(model, inputs)
    got, graphs = compiled_generation(model, inputs)
    assert graphs == 2
    assert_same_generation(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("family", table(FAMILIES))
def test_compiled_static_generation_traces_two_graphs_and_matches_eager(family):
    """Every family: fullgraph compiles, a prefill graph and a decoding graph, eager EA's tokens."""
    skip_unsupported(family)
    assert_two_graphs_with_eager_tokens(evolved_lm(family))


@pytest.mark.slow
def test_learned_gates_compile_into_the_same_two_graphs():
    """A decoder with learned gates (the quickstart's setting, here off the exact start): the gates are read as
    tensors while dynamo traces, so fullgraph compiles the same prefill and decoding graphs, with eager EA's tokens."""
    assert_two_graphs_with_eager_tokens(ea_hf.patch(causal_lm("llama"), **EVOLVED, gates="learned"))


def test_the_kept_rows_of_a_static_cache_are_buffers_allocated_once():
    """The kept rows and the count of tokens seen stay the same tensors from the prefill to the last step, of a
    shape fixed by the cache: the rows over the whole cache (full layers) or the window (sliding layers), plus the
    convolution's ``k // 2`` columns."""
    model = evolved_lm("gemma2")  # full, sliding (4 tokens), full
    inputs = left_padded_inputs()
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(**inputs, past_key_values=cache, use_cache=True)
        histories = getattr(cache, CACHE_ATTRIBUTE)
        assert all(isinstance(history, StaticConvolutionHistory) for history in histories.values())
        buffers = {key: (h.rows.data_ptr(), h.seen_tokens.data_ptr()) for key, h in histories.items()}
        mask = inputs["attention_mask"]
        for step in range(3):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
            token = torch.full((3, 1), 7 + step)
            model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert {key: (h.rows.data_ptr(), h.seen_tokens.data_ptr()) for key, h in histories.items()} == buffers
    shapes = {key[1]: tuple(h.rows.shape) for key, h in histories.items()}
    assert shapes == {0: (3, 4, 1, 17), 1: (3, 4, 1, 10), 2: (3, 4, 1, 17)}  # layer 1's window: the 9-token prefill
    assert {h.seen for h in histories.values()} == {12}


@pytest.mark.full_table  # CI's second stage: fast: the sliding-window cache compiles
@pytest.mark.slow
def test_a_window_filling_while_decoding_recompiles_as_the_plain_model_does():
    """A prompt shorter than the 4-token window: transformers' sliding-window cache layer takes another branch once
    its window is full, which compiles a third graph, unpatched too; EA adds none."""
    inputs = left_padded_inputs(batch=2, length=3)
    _, plain_graphs = compiled_generation(causal_lm("mistral"), inputs)
    torch._dynamo.reset()
    model = evolved_lm("mistral")
    with torch.no_grad():
        expected = static_generation(model, inputs)
    got, graphs = compiled_generation(model, inputs)
    assert graphs == plain_graphs == 3
    assert_same_generation(got, expected)


@pytest.mark.slow
def test_batched_compiled_generation_equals_each_prompt_alone():
    """Left-padded prompts in one compiled batch give each prompt's tokens alone (without padding, eager). Plain
    greedy search: ``generate``'s ban on repeated tokens would ban the padding token in the batch alone. Gemma 2:
    a padded prompt's sliding-window rows too."""
    model = evolved_lm("gemma2")
    inputs = left_padded_inputs()
    batched, _ = compiled_generation(model, inputs, no_repeat_ngram_size=0)
    prompt_length = inputs["input_ids"].shape[1]
    for row in range(inputs["input_ids"].shape[0]):
        real = inputs["attention_mask"][row].bool()
        alone = {name: value[row : row + 1, real] for name, value in inputs.items()}
        with torch.no_grad():
            expected = static_generation(model, alone, no_repeat_ngram_size=0)
        assert torch.equal(batched.sequences[row, prompt_length:], expected.sequences[0, real.sum() :])


def test_the_sliding_window_cache_compiles():
    """``sliding_window``, transformers' older name of the static cache for sliding-window layers."""
    model = evolved_lm("gemma2")
    inputs = left_padded_inputs()
    with torch.no_grad():
        expected = static_generation(model, inputs, cache_implementation="sliding_window")
    got, graphs = compiled_generation(model, inputs, cache_implementation="sliding_window")
    assert graphs == 2
    assert_same_generation(got, expected)


@pytest.mark.slow
def test_the_hybrid_cache_compiles_as_the_plain_model_does():
    """``hybrid``, transformers' older name of the cache for full and sliding-window layers, is the dynamic cache
    in transformers 5.24 (``generate`` drops the name), whose growing keys compile a third graph with dynamic
    shapes, unpatched too."""
    inputs = left_padded_inputs()
    _, plain_graphs = compiled_generation(causal_lm("gemma2"), inputs, cache_implementation="hybrid")
    torch._dynamo.reset()
    model = evolved_lm("gemma2")
    with torch.no_grad():
        expected = static_generation(model, inputs, cache_implementation="hybrid")
    got, graphs = compiled_generation(model, inputs, cache_implementation="hybrid")
    assert graphs == plain_graphs <= 3
    assert_same_generation(got, expected)


@pytest.mark.slow
def test_generate_compiles_the_decoding_steps_on_its_own():
    """transformers' automatic path: with a static cache and ``generation_config.compile_config``, ``generate``
    runs the prefill as it is and compiles the decoding step: Gemma 2 in two graphs, unpatched too, as the first
    decoding step compiles its sliding-window layers' count of tokens as a constant (Llama's, one graph: below)."""
    model = evolved_lm("gemma2")
    inputs = left_padded_inputs()
    with torch.no_grad():
        expected = static_generation(model, inputs)
    counter = GraphCounter()
    config = transformers.CompileConfig(fullgraph=True, backend=counter, mode=None)  # (a mode is inductor's)
    config._compile_all_devices = True  # (transformers compiles on GPUs only unless told)
    model.generation_config.compile_config = config
    with torch.no_grad():
        got = static_generation(model, inputs)
    assert counter.graphs == 2
    assert_same_generation(got, expected)


@pytest.mark.slow
def test_compiled_beam_search_matches_eager():
    """Beam search reorders the kept rows in place between compiled steps, as the static cache its keys."""
    model = evolved_lm("llama")
    inputs = left_padded_inputs()
    with torch.no_grad():
        expected = static_generation(model, inputs, num_beams=3)
    got, graphs = compiled_generation(model, inputs, num_beams=3)
    assert graphs == 2
    assert_same_generation(got, expected)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=TOLERANCE, rtol=0)


def test_eager_decoding_refuses_a_cache_cropped_outside_generate():
    """Outside torch.compile a static cache is checked against its kept rows, as a dynamic one is."""
    model = evolved_lm("llama")
    inputs = left_padded_inputs()
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    step = {"input_ids": torch.full((3, 1), 7), "past_key_values": cache, "use_cache": True}
    if not hasattr(cache.layers[0], "crop"):
        pytest.skip(f"transformers {transformers.__version__}'s static cache cannot be cropped")
    with torch.no_grad():
        model(**inputs, past_key_values=cache, use_cache=True)
        cache.crop(-1)
        mask = torch.cat([inputs["attention_mask"][:, :-1], torch.ones(3, 1, dtype=torch.long)], dim=1)
        with pytest.raises(RuntimeError, match="The KV cache holds 8 earlier tokens but evolving attention"):
            model(**step, attention_mask=mask)


@pytest.mark.slow
@pytest.mark.full_table  # (inductor's C++ build takes a minute here)
def test_inductor_compiled_generation_matches_eager():
    """Inductor, on the prefill and the decoding step, of Gemma 2's full and sliding-window layers (which the
    ``eager`` backend does not check: inductor lowers the graphs itself)."""
    model = evolved_lm("gemma2")
    inputs = left_padded_inputs()
    with torch.no_grad():
        expected = static_generation(model, inputs)
    got, graphs = compiled_generation(model, inputs, backend="inductor")
    assert graphs == 2
    assert_same_generation(got, expected)


@pytest.mark.slow
@pytest.mark.full_table  # (inductor's C++ build, a minute; test_compile.py's aot_eager traces alike)
def test_generate_compiles_llama_decoding_with_inductor():
    """transformers' automatic path with its default backend, inductor (mode None: CUDA graphs are a GPU's): one
    graph for every decoding step."""
    model = evolved_lm("llama")
    inputs = left_padded_inputs()
    with torch.no_grad():
        expected = static_generation(model, inputs)
    counter = GraphCounter("inductor")
    config = transformers.CompileConfig(fullgraph=True, backend=counter, mode=None)
    config._compile_all_devices = True
    with torch.no_grad():
        got = static_generation(model, inputs, compile_config=config)
    assert counter.graphs == 1
    assert_same_generation(got, expected)
