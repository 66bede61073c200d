"""The ``ea-hf`` command's entry point (``[project.scripts]`` in pyproject.toml).

It lives outside the ``ea_hf`` package so that it is imported before ``ea_hf`` is: importing ``ea_hf`` registers
the EA Auto classes with transformers, which imports torch and transformers, except where this module has been
imported (``ea_hf.CLI_ENTRY_POINT``). So ``ea-hf --help``, ``--version`` and each command's ``--help`` answer
without either, and ``ea_hf.cli.main`` registers before a command runs. ``python -m ea_hf.cli`` (what
``torchrun`` and ``accelerate launch -m`` start) does the same work after the usual ``import ea_hf``.
"""

from ea_hf.cli import main

__all__ = ["main"]
