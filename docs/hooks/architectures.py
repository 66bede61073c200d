"""mkdocs hook: the supported-architectures page's tables, generated from ``ea_hf.ARCHITECTURES`` at build time.

The page holds ``<!-- architectures -->`` where the tables go. Each kind gets the guarantees its tests check on
every entry of that kind (the tests take their architecture lists from the same table, by kind), then one row
per ``model_type``: its attention classes, the Auto classes that load it as an EA model, and its notes.
"""

from __future__ import annotations

MARKER = "<!-- architectures -->"

#: What the tests check on every architecture of a kind (tests/modeling, tests/integrations).
GUARANTEES = {
    "every kind": [
        "exact: with alpha = beta = 0 the patched model reproduces the unpatched one, and with random "
        "convolutions it does not (`test_exactness_and_its_converse_on_every_architecture`)",
        "`unpatch` restores the original model exactly (`test_unpatch_restores_the_original_model`)",
        "saves as safetensors with every setting in `config.json`, and every head loads back through its Auto "
        "class (`tests/modeling/test_model_classes.py`)",
        "a LoRA adapter round-trips onto a freshly patched base "
        "(`test_adapter_round_trip_onto_a_freshly_patched_base`)",
    ],
    "text encoder": [
        "padding: each example of a right-padded batch gives what it gives alone, for every evolution method, and "
        "without the convolution's padding mask it does not (`test_padding_invariance_*`)",
    ],
    "vision encoder": ["images have no padding: every patch attends to every other"],
    "audio encoder": [
        "wav2vec 2.0 and HuBERT: padded waveforms give, at their frames, what they give alone, and without the "
        "convolution's padding mask they do not; AST reads fixed-length spectrograms (no padding)",
    ],
    "seq2seq": [
        "three chains (encoder, decoder, cross) with their own settings",
        "causality: later decoder tokens change nothing before them",
        "source padding changes nothing (text models; Whisper's encoder takes no padding mask), and without "
        "the convolution's padding mask it does",
        "`generate` gives the same tokens with and without the KV cache (greedy and beam search), and with "
        "zero weights what the unpatched model generates",
    ],
    "decoder-only": [
        "one causal chain per attention type (full and sliding layers apart)",
        "causality: changing the tokens after position i leaves every output at or before i bit-identical "
        "(mixtures of experts: within 1e-5, the unpatched model's own rounding)",
        "left padding: each prompt's logits in a padded batch are its logits alone, within 1e-5",
        "`generate` gives the same tokens with and without the KV cache: greedy, beam search and sampling, "
        "with the dynamic and the static cache",
    ],
}


TITLES = {
    "text encoder": "Text encoders",
    "vision encoder": "Vision encoders",
    "audio encoder": "Audio encoders",
    "seq2seq": "Sequence-to-sequence models",
    "decoder-only": "Decoder-only language models",
}


def _row(model_type: str, spec) -> str:
    from ea_hf.modeling.model_classes import auto_class_names

    names = {name.removeprefix("AutoModelFor").removeprefix("AutoModel") for name in auto_class_names(model_type)}
    names = {name or "Model" for name in names}
    heads = sorted(names, key=lambda head: (head != "Model", head))
    notes = []
    if spec.since:
        notes.append(f"transformers {spec.since} and newer")
    if spec.shared_layers:
        notes.append("one attention module serves every layer")
    if spec.cross_attention and spec.kind != "seq2seq":
        notes.append("cross-attention when built as a decoder of an encoder")
    classes = ", ".join(f"`{name}`" for name in spec.attention)
    return f"| `{model_type}` | {classes} | {', '.join(heads)} | {'; '.join(notes)} |"


def architectures_markdown() -> str:
    """The tables, one per kind, with the guarantees above each."""
    from ea_hf.modeling.architectures import ARCHITECTURES, KINDS, model_types_of_kind

    parts = ["Every supported architecture is checked by the tests for:", ""]
    parts += [f"- {line}" for line in GUARANTEES["every kind"]]
    for kind in KINDS:
        entries = {model_type: ARCHITECTURES[model_type] for model_type in model_types_of_kind(kind)}
        parts += ["", f"### {TITLES[kind]}", "", f"{len(entries)} architectures. Also checked on each of them:", ""]
        parts += [f"- {line}" for line in GUARANTEES[kind]]
        parts += ["", "| model_type | attention | loads as EA through AutoModel… | notes |"]
        parts += ["| --- | --- | --- | --- |"]
        parts += [_row(model_type, spec) for model_type, spec in sorted(entries.items())]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, **_) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, architectures_markdown())
