"""Implementations of the ``ea-hf`` sub-commands (imported lazily: they pull in torch and transformers)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

import ea_hf


def _model_class(model: str, auto_class: str | None) -> type:
    if auto_class is not None:
        cls = getattr(transformers, auto_class, None)
        if cls is None:
            raise ValueError(f"transformers has no class {auto_class!r}")
        return cls
    config = transformers.AutoConfig.from_pretrained(model)
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def _save_preprocessor(model: str, out_dir: Path) -> str | None:
    """Copy the tokenizer or image processor of ``model`` next to the patched weights, if it has one."""
    for loader in (transformers.AutoTokenizer, transformers.AutoImageProcessor):
        try:
            preprocessor = loader.from_pretrained(model)
        except (OSError, ValueError, KeyError):
            continue
        preprocessor.save_pretrained(out_dir)
        return type(preprocessor).__name__
    return None


def patch(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory")
    settings = ea_hf.EvolvingAttentionSettings(args.alpha, args.beta, args.kernel_size, args.layers, args.init)
    model = _model_class(args.model, args.auto_class).from_pretrained(args.model)
    torch.manual_seed(args.seed)
    ea_hf.patch(model, **settings.to_dict(), decoder=args.decoder, cross=args.cross)
    model.save_pretrained(out_dir)
    preprocessor = _save_preprocessor(args.model, out_dir)
    print(ea_hf.summary(model))
    print(f"saved {type(model).__name__} to {out_dir}" + (f" with its {preprocessor}" if preprocessor else ""))
    return 0


def summary(args: argparse.Namespace) -> int:
    model = transformers.AutoModel.from_pretrained(args.model)
    if not ea_hf.is_patched(model):
        raise ValueError(f"{args.model} is not an evolving attention checkpoint")
    print(ea_hf.summary(model))
    return 0
