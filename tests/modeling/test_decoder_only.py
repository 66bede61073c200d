"""Decoder-only language models (GPT-2, Llama, Mistral, Qwen 2/3, Gemma 1/2/3, Phi 1-3, GPT-NeoX, OLMo 2,
Granite, SmolLM3, StarCoder2, OPT, the Mixtral and Qwen3-MoE mixtures of experts, and the BERT and BART
families' decoders): exactness, causality, left padding, cache-exact generation, checkpointing, pipelines."""

import copy

import pytest
import torch
import transformers
from testing import (
    CAUSAL_LM_FAMILIES,
    GENERATION_MODES,
    GENERATION_NOISE,
    NUM_HEADS,
    NUM_LAYERS,
    PAD,
    VOCAB_SIZE,
    attention_layers,
    cached_and_uncached_generation,
    causal_lm,
    checkpointing_changes_no_gradient,
    generate,
    generation_gap,
    left_padded_inputs,
    max_abs_diff,
    routing_noise,
    table,
)

import ea_hf
from ea_hf.modeling import attention as attention_module
from ea_hf.modeling import history as history_module
from ea_hf.modeling.architectures import release
from ea_hf.modeling.history import CACHE_ATTRIBUTE

FAMILIES = list(CAUSAL_LM_FAMILIES)
EVOLVED = {"alpha": 0.4, "beta": 0.5}
#: Families whose layers alternate full and sliding-window (or chunked) attention (``config.layer_types``).
ALTERNATING = ["qwen2", "qwen3", "gemma2", "gemma3_text", "cohere2", "olmo3", "ministral", "vaultgemma"]
ALTERNATING += ["gemma4_text", "llama4_text", "gpt_oss"]
#: Families whose position embeddings do not follow ``position_ids`` (the BART family counts positions from the
#: first column), so a left-padded prompt is not the same input as the prompt alone, patched or not.
ABSOLUTE_FROM_FIRST_COLUMN = ["bart-causal", "mbart-causal"]


def evolved_lm(family: str, **overrides):
    return ea_hf.patch(causal_lm(family, **overrides), **EVOLVED)


def real_tokens(inputs, output):
    return output[inputs["attention_mask"].bool()]


def position_ids(attention_mask):
    """Positions counted from each sequence's first real token, as ``generate`` computes them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


# --------------------------------------------------------------------------------------------------
# Chains
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", table(FAMILIES))
def test_one_causal_chain_per_attention_type(family):
    model = evolved_lm(family)
    rows = [row for row in ea_hf.summary(model).modules if row.role == "decoder"]
    layers = attention_layers(model.config)  # every layer but Qwen3.5's linear-attention one
    assert len(layers) == NUM_LAYERS and [row.layer for row in rows] == list(layers)
    assert {(row.alpha, row.beta) for row in rows} == {(0.4, 0.5)}  # a decoder-only model's own settings
    # Causal kernels keep the rows at and above the centre; one channel per query head (grouped-query
    # attention has 2 key/value heads here).
    assert {row.parameters for row in rows} == {NUM_HEADS**2 * 6 + NUM_HEADS}
    # Each layer takes the map of the last attention layer before it of its own type: in full, sliding, full
    # (or chunked) the middle layer starts a chain of its own, and the last layer continues the first's.
    previous = [max((j for j in layers if j < i and layers[j] == layers[i]), default=None) for i in layers]
    assert [row.previous_layer for row in rows] == previous
    if family in ALTERNATING:
        assert previous == [None, None, 0]


def test_a_hybrid_evolves_its_attention_layers_alone():
    """Qwen3.5: the linear-attention layer (a gated delta net, layer 1 here) has no map and stays as it is; layers
    are named in the model's own numbering, and a linear-attention one is refused, not silently left plain."""
    model = causal_lm("qwen3_5_text")
    with pytest.raises(ValueError, match=r"layers \[1\] of model \(decoder\) have no attention map to evolve; its "):
        ea_hf.patch(model, **EVOLVED, layers=[1, 3])
    ea_hf.patch(model, **EVOLVED, layers=[0, 3])
    assert [(row.layer, row.previous_layer) for row in ea_hf.summary(model).modules] == [(0, None), (3, 0)]
    assert not any("evolving_attention" in name for name, _ in model.model.layers[1].named_modules())


# --------------------------------------------------------------------------------------------------
# Exactness, causality, padding
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", table(FAMILIES))
def test_zero_weights_reproduce_the_model(family):
    """alpha = beta = 0 computes what the unpatched model computes with its default attention (sdpa; eager for
    Gemma 2, see testing.py), on a left-padded batch, and generates the same tokens."""
    model = causal_lm(family)
    inputs = left_padded_inputs()
    with torch.no_grad():
        reference = model(**inputs).logits
        reference_tokens = generate(model, inputs)
        ea_hf.patch(model, alpha=0.0, beta=0.0)
        patched = model(**inputs).logits
        assert max_abs_diff(real_tokens(inputs, patched), real_tokens(inputs, reference)) <= 1e-5
        assert generation_gap(generate(model, inputs), reference_tokens) <= 1e-5
        # ... and non-zero weights do change it: the comparison is not vacuous.
        changed = evolved_lm(family)(**inputs).logits
    assert max_abs_diff(real_tokens(inputs, changed), real_tokens(inputs, reference)) > 1e-2


@pytest.mark.parametrize("family", table(FAMILIES))
def test_later_tokens_change_nothing_before_them(family):
    model, noise = evolved_lm(family), routing_noise(family)
    input_ids = left_padded_inputs(batch=2, length=10)["input_ids"]
    with torch.no_grad():
        reference = model(input_ids=input_ids, output_hidden_states=True)
        for i in range(input_ids.shape[1] - 1):
            changed = input_ids.clone()
            changed[:, i + 1 :] = torch.randint(5, VOCAB_SIZE, changed[:, i + 1 :].shape)
            out = model(input_ids=changed, output_hidden_states=True)
            assert max_abs_diff(out.logits[:, : i + 1], reference.logits[:, : i + 1]) <= noise, i
            for hidden, ref in zip(out.hidden_states, reference.hidden_states, strict=True):
                assert max_abs_diff(hidden[:, : i + 1], ref[:, : i + 1]) <= noise, i
            assert max_abs_diff(out.logits[:, i + 1 :], reference.logits[:, i + 1 :]) > 1e-3


def test_a_non_causal_kernel_would_leak():
    """The converse: a full (centred) kernel in a decoder reads the next position."""
    model = evolved_lm("llama")
    evolution = model.model.layers[0].self_attn.evolving_attention
    full = torch.zeros(NUM_HEADS, NUM_HEADS, 3, 3)
    full[:, :, :2] = evolution.weight.detach()
    full[:, :, 2] = 1.0
    evolution.causal, evolution.weight = False, torch.nn.Parameter(full)
    input_ids = left_padded_inputs(batch=2)["input_ids"]
    changed = input_ids.clone()
    changed[:, 4:] = 7
    with torch.no_grad():
        assert max_abs_diff(model(input_ids=changed).logits[:, 3], model(input_ids=input_ids).logits[:, 3]) > 1e-3


def padded_prompts(family: str) -> tuple[dict, dict]:
    """A padded batch of prompts for ``family`` (left-padded, or right-padded where positions count from the
    first column) and the position ids that give each prompt the positions it has alone."""
    inputs = left_padded_inputs()
    if family in ABSOLUTE_FROM_FIRST_COLUMN:  # right padding there: the same positions as alone
        inputs = {name: value.flip(-1) for name, value in inputs.items()}
    mask = inputs["attention_mask"]
    # RoBERTa numbers positions after its padding index (what it derives from PAD tokens itself).
    positions = {"position_ids": mask.cumsum(-1) * mask + PAD if family == "roberta-decoder" else position_ids(mask)}
    return inputs, positions


def padding_difference(model, family: str) -> float:
    """The largest difference between each prompt's logits in the padded batch and alone, at its real tokens."""
    inputs, positions = padded_prompts(family)
    with torch.no_grad():
        batched = model(**inputs, **positions).logits
        worst = 0.0
        for row in range(inputs["input_ids"].shape[0]):
            real = inputs["attention_mask"][row].bool()
            alone = {name: value[row : row + 1, real] for name, value in inputs.items()}
            worst = max(worst, max_abs_diff(batched[row, real], model(**alone).logits[0]))
    return worst


@pytest.mark.parametrize("family", table(FAMILIES))
def test_left_padding_changes_nothing(family):
    """Each prompt of a left-padded batch gives the logits and the generated tokens it gives alone."""
    model = evolved_lm(family)
    assert padding_difference(model, family) <= 1e-5
    inputs, positions = padded_prompts(family)
    # The padding token is never generated: `no_repeat_ngram_size` would otherwise ban it in padded rows only.
    never_pad = {"bad_words_ids": [[PAD]]}
    with torch.no_grad():
        batched = model(**inputs, **positions).logits
        generated = generate(model, inputs, **never_pad) if family not in ABSOLUTE_FROM_FIRST_COLUMN else None
        for row in range(inputs["input_ids"].shape[0]):
            real = inputs["attention_mask"][row].bool()
            alone = {name: value[row : row + 1, real] for name, value in inputs.items()}
            if generated is not None:
                new_tokens = generate(model, alone, **never_pad).sequences[0, real.sum() :]
                assert torch.equal(generated.sequences[row, real.shape[0] :], new_tokens), row
        # What sits under the padding never matters.
        noisy = dict(inputs, input_ids=inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, 42))
        noisy_logits = model(**noisy, **positions).logits
    assert max_abs_diff(real_tokens(inputs, noisy_logits), real_tokens(inputs, batched)) <= max(
        routing_noise(family), 1e-6
    )


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gemma2", "biogpt", "olmoe", "bart-causal"])
def test_padding_moves_the_logits_without_the_convolution_mask(family, monkeypatch):
    """The converse: a convolution that reads the padded columns' logits moves the real tokens' (0.04 to 0.15
    apart on these tiny models, against at most 1.4e-6 with the mask)."""
    monkeypatch.setattr(attention_module, "convolution_mask", lambda *arguments: None)
    assert padding_difference(evolved_lm(family), family) > 1e-2


# --------------------------------------------------------------------------------------------------
# Generation with the KV cache
# --------------------------------------------------------------------------------------------------

MODES = GENERATION_MODES | {"sample": {"num_beams": 1, "do_sample": True, "top_k": 0}}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", table(FAMILIES))
def test_generation_with_the_cache_equals_generation_without(family, mode):
    if family == "llama4_text" and "static" in mode and release(transformers.__version__) < release("5.20.0"):
        pytest.skip(
            "before transformers 5.20 Llama 4 cannot generate with a static cache, patched or not (its chunked "
            "layers' mask function takes no block_sequence_ids)"
        )
    model = evolved_lm(family)
    inputs = left_padded_inputs()
    settings = MODES[mode]
    with torch.no_grad():
        cached = cached_and_uncached_generation(model, inputs, GENERATION_NOISE.get(family, 1e-5), **settings)
    histories = cached.past_key_values.__dict__[CACHE_ATTRIBUTE]
    assert {key for key in histories if key[0] == "decoder"} == {("decoder", i) for i in attention_layers(model.config)}
    assert {h.seen for h in histories.values()} == {cached.sequences.shape[1] - 1}


def test_a_cache_that_does_not_reach_the_convolution_is_an_error(monkeypatch):
    """An attention module taking its KV cache under a name ea_hf does not know: decoding steps refuse to run
    instead of convolving one row without the earlier ones (GPT-NeoX's ``layer_past`` was such a name)."""
    model = evolved_lm("gpt_neox")
    inputs = left_padded_inputs()
    monkeypatch.setattr(attention_module, "CACHE_ARGUMENTS", ("cache", "past_key_values"))
    with torch.no_grad():
        model(**inputs)  # without a cache, a forward pass has as many keys as queries
        with pytest.raises(RuntimeError, match="GPTNeoXAttention attends to 10 keys from 1 queries, but its KV cache"):
            generate(model, inputs)
    monkeypatch.undo()
    with torch.no_grad():
        cached_and_uncached_generation(model, inputs)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_generation_needs_the_kept_rows_and_their_alignment(family, monkeypatch):
    """The converse: forget the earlier rows, or align a sliding window's rows by column instead of by
    position, and cached generation differs (so the test above would catch either)."""
    model = evolved_lm(family)
    inputs = left_padded_inputs()
    with torch.no_grad():
        reference = generate(model, inputs, use_cache=False)
        with monkeypatch.context() as patched:
            patched.setattr(history_module, "first_key_position", lambda *args: 0)
            assert generation_gap(generate(model, inputs), reference) > 1e-3
        with monkeypatch.context() as patched:
            forget = history_module.ConvolutionHistory.extend

            def extend_without_history(self, new_rows, keep):
                self.rows = None
                return forget(self, new_rows, keep)

            patched.setattr(history_module.ConvolutionHistory, "extend", extend_without_history)
            assert generation_gap(generate(model, inputs), reference) > 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_a_second_turn_continues_from_the_returned_cache(family):
    """A chat's second turn: the first turn's cache (with its kept rows) is passed back to generate."""
    model = evolved_lm(family)
    inputs = left_padded_inputs()
    with torch.no_grad():
        first = generate(model, inputs, max_new_tokens=4, min_new_tokens=4)
        reply = torch.randint(5, VOCAB_SIZE, (3, 3), generator=torch.Generator().manual_seed(5))
        second_ids = torch.cat([first.sequences, reply], dim=1)
        mask = torch.cat([inputs["attention_mask"], torch.ones(3, 7, dtype=torch.long)], dim=1)
        second = {"input_ids": second_ids, "attention_mask": mask}
        continued = generate(model, second, past_key_values=first.past_key_values)
        fresh = generate(model, second, use_cache=False)
    assert generation_gap(continued, fresh) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_prefix_cache_computed_once_serves_several_continuations(family):
    model = evolved_lm(family)
    prefix = left_padded_inputs(batch=1, length=6)
    with torch.no_grad():
        prefix_cache = transformers.DynamicCache(config=model.config)
        model(**prefix, past_key_values=prefix_cache, use_cache=True)
        for seed in (1, 2):
            suffix = torch.randint(5, VOCAB_SIZE, (1, 3), generator=torch.Generator().manual_seed(seed))
            ids = torch.cat([prefix["input_ids"], suffix], dim=1)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            continued = generate(model, inputs, past_key_values=copy.deepcopy(prefix_cache))
            assert generation_gap(continued, generate(model, inputs, use_cache=False)) <= 1e-5
    assert prefix_cache.__dict__[CACHE_ATTRIBUTE][("decoder", 0)].seen == 6  # the copies left it as it was
    for history in prefix_cache.__dict__[CACHE_ATTRIBUTE].values():
        # Its own copy of the last k//2 rows (not a view that would keep the prefill's whole map alive).
        assert history.rows.shape[-2] == 1 and history.rows.untyped_storage().nbytes() == history.rows.nbytes


def test_assisted_decoding_is_refused_clearly():
    model, assistant = evolved_lm("llama"), causal_lm("llama", seed=1)
    inputs = left_padded_inputs(batch=1)
    with pytest.raises(ValueError, match="does not support assisted decoding"):
        model.generate(**inputs, assistant_model=assistant, max_new_tokens=4, pad_token_id=PAD)
    with pytest.raises(ValueError, match="does not support assisted decoding"):
        model.generate(**inputs, prompt_lookup_num_tokens=2, max_new_tokens=4, pad_token_id=PAD)


# --------------------------------------------------------------------------------------------------
# Training and pipelines
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2", "bart-causal"])
def test_gradient_checkpointing_gives_the_same_gradients(family):
    inputs = left_padded_inputs()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    plain = checkpointing_changes_no_gradient(lambda: evolved_lm(family), **inputs, labels=labels)
    # Every self-attention layer's convolution learns (BART's cross-attention ones get no gradient: no encoder).
    evolution = [n for n in plain if "evolving_attention.weight" in n]
    assert len(evolution) == NUM_LAYERS and all(plain[n].abs().sum() > 0 for n in evolution)


def test_text_generation_pipeline(minilm_tokenizer):
    """pipeline("text-generation") on an EA model: the text is what generate produces."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=minilm_tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=minilm_tokenizer.pad_token_id,
        initializer_range=0.2,
    )
    model = ea_hf.patch(transformers.LlamaForCausalLM(config).eval(), **EVOLVED)
    tokenizer = copy.deepcopy(minilm_tokenizer)
    tokenizer.model_input_names = ["input_ids", "attention_mask"]  # a BERT tokenizer; Llama takes no token types
    generator = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompt = "evolving attention decodes"
    text = generator(prompt, max_new_tokens=5, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=config.pad_token_id)
    assert text == tokenizer.decode(expected[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(text.split()) >= 2


@pytest.mark.full_table  # CI's second stage: fast: MiniLM, and every tiny decoder
@pytest.mark.slow
def test_pretrained_smollm2(smollm2_path):
    """A real pretrained decoder (SmolLM2-135M-Instruct): alpha = beta = 0 reproduces it (sdpa) and generates
    the same text; evolved, it generates the same tokens with and without the KV cache."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    inputs = tokenizer(
        ["The capital of France is", "In a plain transformer, every layer"], return_tensors="pt", padding=True
    )
    greedy = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        reference = model(**inputs).logits
        reference_text = model.generate(**inputs, **greedy)
        ea_hf.patch(model, alpha=0.0, beta=0.0)
        assert max_abs_diff(real_tokens(inputs, model(**inputs).logits), real_tokens(inputs, reference)) <= 1e-4
        exact = model.generate(**inputs, **greedy)
        assert generation_gap(exact, reference_text) <= 1e-4
        assert "Paris" in tokenizer.decode(exact.sequences[0])
        ea_hf.unpatch(model)
        torch.manual_seed(0)
        ea_hf.patch(model, alpha=0.2, beta=0.2)
        cached, uncached = (model.generate(**inputs, **greedy, use_cache=flag) for flag in (True, False))
    assert generation_gap(cached, uncached) <= 1e-4
    assert generation_gap(cached, reference_text) > 1e-3  # the random convolutions do change the model


def test_lora_on_a_causal_lm_trains_the_evolution():
    peft = pytest.importorskip("peft", reason="PEFT adapters are the optional peft extra")
    from ea_hf.integrations.peft import lora_config

    model = evolved_lm("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "evolving_attention" in n}
    peft_model = peft.get_peft_model(model, lora_config(model, r=4, lora_dropout=0.0, task_type="CAUSAL_LM"))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert sum(".evolving_attention." in n for n in trainable) == 2 * NUM_LAYERS
    assert sum("lora_A" in n for n in trainable) == 4 * NUM_LAYERS  # q, k, v and o of each layer
    inputs = left_padded_inputs()
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.1)
    peft_model.train()
    peft_model(**inputs, labels=inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)).loss.backward()
    optimizer.step()
    # The trained copies: base_model.model.<name> with modules_to_save.default before the weight's own name.
    trained = {
        name.removeprefix("base_model.model.").replace("modules_to_save.default.", ""): parameter
        for name, parameter in peft_model.named_parameters()
        if ".evolving_attention.modules_to_save." in name
    }
    assert trained.keys() == before.keys()
    assert all(max_abs_diff(trained[name], before[name]) > 0 for name in before)
