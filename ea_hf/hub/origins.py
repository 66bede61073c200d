"""Where a checkpoint comes from: its Hub id and license, read from the recipe's name for it and the
checkpoint's own files without any network (:func:`checkpoint_origin`). Model cards name a base model by its Hub
id only, never by a local path or ``package:NAME``.

Example (offline):
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "README.md").write_text("---\\nlicense: mit\\n---\\n# tiny\\n\\nfrom_pretrained('me/tiny')\\n")
    >>> checkpoint_origin(str(folder), folder)
    Origin(hub_id='me/tiny', license={'license': 'mit'})
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import ModelCard, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError

#: How a Hub repository id is spelt (``owner/name`` or a bare ``name``).
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def reads_as_hub_id(name: str | None) -> bool:
    """Whether ``name`` is spelt as a Hub repository id (not a path with a leading slash, not ``package:NAME``);
    reads no file, so a relative path spelt like an id passes (:func:`checkpoint_origin` tells them apart).

    Example:
        >>> [reads_as_hub_id(name) for name in ("owner/model", "/data/model", "package:x", None)]
        [True, False, False, False]
    """
    return bool(name) and _HUB_ID.fullmatch(name) is not None


def _is_hub_id(name: str | None) -> bool:
    """Whether ``name`` is a Hub repository id rather than a local path or ``package:NAME``."""
    return reads_as_hub_id(name) and not Path(name).exists()


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a checkpoint comes from, as far as the recipe and the checkpoint's own files tell: its Hub id and
    its license as its model card's metadata states it (``license``, and ``license_name``/``license_link`` for
    ``license: other``); None and empty when unknown."""

    hub_id: str | None = None
    license: Mapping[str, str] = dataclasses.field(default_factory=dict)


#: A Hub model id quoted in a model card's text (``from_pretrained('owner/name')``) or linked to.
_QUOTED_ID = re.compile(r"""["'`]([\w.-]+/[\w.-]+)["'`]""")
_LINKED_ID = re.compile(r"huggingface\.co/(?!datasets/|spaces/)([\w.-]+/[\w.-]+?)(?=[)\s\"'>]|$)")
#: A snapshot of a Hub model in the Hub cache: ``models--owner--name/snapshots/<revision>``.
_CACHED_SNAPSHOT = re.compile(r"models--([\w.-]+?)--([\w.-]+)/snapshots/[^/]+/?$")


def checkpoint_origin(
    name_or_path: str | None, folder: str | Path | None = None, revision: str | None = None
) -> Origin:
    """The Hub id and license of the checkpoint a model was made from, read without any network; never a
    local path or a ``package:NAME`` form (those give no Hub id).

    * ``name_or_path`` that is a Hub id (and no local path) is the Hub id; its license is read from its model
      card when the Hub cache holds it (``from_pretrained`` does not download README.md, so it is often
      unknown: omitted rather than guessed).
    * A local checkpoint (``folder``: the directory ``name_or_path`` resolves to, e.g. the one a Python
      package ships for ``package:NAME``) has a Hub id when it is a snapshot in the Hub cache, or when its own
      model card (README.md) names it: an ``owner/name`` quoted in the card (as in its usage code) or linked
      to, whose ``name`` is the card's title or ``model_name``. Its license is the card's ``license``. (The
      packaged all-MiniLM-L6-v2 is ``sentence-transformers/all-MiniLM-L6-v2``, apache-2.0.)
    * ``_name_or_path`` in config.json is not used: it records the model the checkpoint was loaded from
      before it was saved, i.e. its own base (the packaged all-MiniLM-L6-v2 says
      ``nreimers/MiniLM-L6-H384-uncased``), and the card's ``base_model`` metadata likewise names the
      checkpoint's base, not the checkpoint.
    """
    if _is_hub_id(name_or_path):
        try:
            readme = try_to_load_from_cache(name_or_path, "README.md", revision=revision)
        except HFValidationError:  # not a name the Hub allows (``a--b/c``): not a Hub id
            return Origin()
        card = _read_card(Path(readme)) if isinstance(readme, str) else None
        return Origin(name_or_path, _card_license(card))
    if folder is None or not Path(folder).is_dir():
        return Origin()
    folder = Path(folder).resolve()
    card = _read_card(folder / "README.md")
    cached = _CACHED_SNAPSHOT.search(folder.as_posix())
    hub_id = f"{cached[1]}/{cached[2]}" if cached else _own_hub_id(card)
    return Origin(hub_id, _card_license(card))


def _read_card(path: Path) -> ModelCard | None:
    if not path.is_file():
        return None
    try:
        return ModelCard(path.read_text(encoding="utf-8"), ignore_metadata_errors=True)
    except (ValueError, UnicodeDecodeError):
        return None


def _card_license(card: ModelCard | None) -> dict[str, str]:
    if card is None:
        return {}
    fields = ("license", "license_name", "license_link") if card.data.license == "other" else ("license",)
    return {name: str(card.data.get(name)) for name in fields if card.data.get(name)}


def _own_hub_id(card: ModelCard | None) -> str | None:
    """The Hub id a model card gives its own model: the one ``owner/name`` it quotes or links to whose
    ``name`` is the card's title (its first heading) or ``model_name``; None if none or several."""
    if card is None:
        return None
    title = re.search(r"^#\s+(.+?)\s*$", card.text, flags=re.MULTILINE)
    names = {name.lower() for name in (card.data.model_name, title[1] if title else None) if name}
    candidates = _QUOTED_ID.findall(card.text) + _LINKED_ID.findall(card.text)
    found = {hub_id for hub_id in candidates if hub_id.split("/")[1].lower() in names}
    return found.pop() if len(found) == 1 else None
