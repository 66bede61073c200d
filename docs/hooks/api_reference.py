"""griffe extensions (mkdocs.yml, mkdocstrings' python handler): the Sphinx roles of the docstrings as links, their
``Example:`` sections as doctests, and the classes a module makes at import (``EASection = ea_section_class()``) as
classes.

The docstrings cite other objects as Sphinx does, ``:func:`~.step.packed_gate```: the files of ``ea_hf/modeling/``
are copied beside saved checkpoints, where the package is not ``ea_hf``, so they cite their siblings relatively.
Each role becomes an optional cross-reference of mkdocs-autorefs: a link where the API reference documents the
object, its name as code where it does not. tests/test_references.py checks that every role names an object that
exists (with :data:`ROLE` and :func:`absolute_target`, which it imports from here).
"""

from __future__ import annotations

import html
import importlib
import re

import griffe
from griffe import Extension, Object

#: A Sphinx role: ``:func:`target```, the target optionally ``~``-prefixed (shown by its last name).
ROLE = re.compile(r":(?:func|class|meth|data|attr|mod|exc|obj|const):`(?P<tilde>~?)(?P<target>[\w.]+)`")


def absolute_target(target: str, module: str, is_package: bool) -> str | None:
    """The dotted path of a role's target written in ``module`` where it is relative (``.step.packed_gate`` in
    ``ea_hf.modeling.kernels`` -> ``ea_hf.modeling.step.packed_gate``), None where it is not (a plain name:
    the module's own, or an absolute path)."""
    if not target.startswith("."):
        return None
    package = module if is_package else module.rpartition(".")[0]
    return package + target


def _identifier(target: str, obj: Object) -> str:
    module = obj.module
    relative = absolute_target(target, module.path, module.is_init_module)
    if relative is not None:
        return relative
    first = target.split(".")[0]
    scope = obj if obj.is_class else obj.parent
    while scope is not None and not scope.is_module:  # a method's class, then the module: as Sphinx looks
        if first in scope.members:
            return f"{scope.path}.{target}"
        scope = scope.parent
    return f"{module.path}.{target}" if first in module.members else target


def _link(match: re.Match[str], obj: Object) -> str:
    target = match["target"]
    shown = target.rpartition(".")[2] if match["tilde"] else target.lstrip(".")
    identifier = html.escape(_identifier(target, obj), quote=True)
    return f'<autoref identifier="{identifier}" optional><code>{html.escape(shown)}</code></autoref>'


#: The project's ``Example:`` sections; griffe reads ``Examples:`` as doctests (code blocks) and any other title
#: as an admonition of Markdown, where ``>>>`` would be quotes.
EXAMPLE_SECTION = re.compile(r"^(\s*)Example:\s*$", flags=re.M)


def _convert(obj: Object) -> None:
    if obj.docstring is not None:
        value = ROLE.sub(lambda match: _link(match, obj), obj.docstring.value)
        obj.docstring.value = EXAMPLE_SECTION.sub(r"\1Examples:", value)
    for member in obj.members.values():
        if not member.is_alias:
            _convert(member)


class ReferenceDocstrings(Extension):
    """Rewrites the roles and the Example sections once the package is loaded, when every module's names are known."""

    def on_package(self, *, pkg: Object, **kwargs: object) -> None:
        _convert(pkg)


class ClassesMadeAtImport(Extension):
    """Static analysis sees ``EASection = ea_section_class()`` as an attribute: put the class that the module
    holds at run time in its place, read by inspection (its fields, signature and docstring)."""

    def on_package(self, *, pkg: Object, **kwargs: object) -> None:
        for module in [pkg, *_submodules(pkg)]:
            for name, member in list(module.members.items()):
                if (
                    not member.is_alias
                    and member.is_attribute
                    and name[:1].isupper()
                    and isinstance(member.value, griffe.ExprCall)
                ):
                    value = getattr(importlib.import_module(module.path), name, None)
                    if isinstance(value, type) and value.__module__ == module.path and value.__name__ == name:
                        made = griffe.inspect(module.path)[name]
                        module.set_member(name, made)
                        _convert(made)  # whichever extension runs first (converting twice changes nothing)


def _submodules(module: Object) -> list[Object]:
    found = []
    for member in module.members.values():
        if not member.is_alias and member.is_module:
            found += [member, *_submodules(member)]
    return found
