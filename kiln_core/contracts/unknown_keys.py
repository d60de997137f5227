"""Unknown keys in a request or spec: found, named with their path, and matched to the closest field.

Kiln's ``OpdRequest`` and ``OpdConfig`` are serde structs without ``deny_unknown_fields``
(``crates/kiln-train/src/opd.rs``), so Kiln drops a key it does not know without a word: a request
whose config says ``learnign_rate`` trains at the default rate. kiln-flows refuses such a key, naming
it and the field it probably meant; ``--kiln-lenient`` restores Kiln's behaviour (each ignored key is
then printed and recorded in the receipt). Blocks that Kiln itself closes (the optimizer, which
denies unknown fields) stay refused either way.

The walk follows the pydantic model: a key that is no field (or alias) of the model is unknown; a
known key whose value is a nested model (``config``, ``config.echo``, the ``stable_opd`` variant its
``mode`` picks) is walked in turn. Lists (``prompts``) and free-form values (``post_eval``) are not
walked: they have their own parsers.

Example:
    >>> from pydantic import BaseModel
    >>> class Block(BaseModel):
    ...     learning_rate: float = 0.1
    >>> [key.describe() for key in find_unknown_keys({"learnign_rate": 1}, Block, prefix="config.")]
    ['`config.learnign_rate`: unknown key (not a field of `config`); did you mean `learning_rate`?']
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pydantic import BaseModel

__all__ = ["UnknownKey", "find_unknown_keys", "closest_name"]

# difflib's ratio above which a known name counts as "what you probably meant" (its own default).
SUGGESTION_CUTOFF = 0.6


@dataclass(frozen=True)
class UnknownKey:
    """One key no field knows.

    Attributes:
        path: Dotted path of the key (``config.learnign_rate``).
        suggestion: The closest known name at that level, or None when nothing is close.
        owner: What the key is not a field of, for the message (``Kiln's OpdConfig``, ``config.echo``).
        kiln_refuses: True where Kiln refuses the key too (a block with ``deny_unknown_fields``), so even
            ``--kiln-lenient`` cannot ignore it.
    """

    path: str
    suggestion: str | None
    owner: str | None = None
    kiln_refuses: bool = False

    def describe(self) -> str:
        """```config.learnign_rate`: unknown key (not a field of Kiln's OpdConfig); did you mean `learning_rate`?``"""
        text = f"`{self.path}`: unknown key"
        if self.owner:
            text += f" (not a field of {self.owner})"
        if self.suggestion:
            text += f"; did you mean `{self.suggestion}`?"
        return text


def closest_name(key: str, names: Iterable[str]) -> str | None:
    """The known name closest to ``key`` (difflib's ratio), or None when none is close.

    Example:
        >>> closest_name("lora_rnak", ["lora_rank", "lora_alpha", "seed"])
        'lora_rank'
    """
    matches = difflib.get_close_matches(key, sorted(names), n=1, cutoff=SUGGESTION_CUTOFF)
    return matches[0] if matches else None


def find_unknown_keys(value: Any, model: type[BaseModel], *, prefix: str = "",
                      owners: Mapping[type[BaseModel], str] | None = None,
                      tolerated: Iterable[str] = ()) -> list[UnknownKey]:
    """Every key of ``value`` (a decoded JSON object) that ``model`` does not know, in document order.

    Args:
        value: The decoded object; anything but a dict has no keys to check.
        model: The pydantic model ``value`` is parsed into.
        prefix: Path of ``value`` itself (``"config."``), prepended to each key's path.
        owners: How the message names a model (``{OpdConfig: "Kiln's OpdConfig"}``); a model not named
            here is named by its path (``config.echo``).
        tolerated: Full paths of keys Kiln knows but ignores on input (``config.grad_checkpoint_segments``).

    Returns:
        The unknown keys; empty when every key is a field.
    """
    if not isinstance(value, dict):
        return []
    tolerated, owners = frozenset(tolerated), owners or {}
    owner = owners.get(model) or (f"`{prefix.rstrip('.')}`" if prefix else None)
    names = _field_names(model)
    refuses = model.model_config.get("extra") == "forbid"
    found: list[UnknownKey] = []
    for key, item in value.items():
        path = f"{prefix}{key}"
        if key not in names:
            if path not in tolerated:
                found.append(UnknownKey(path, closest_name(str(key), names), owner, refuses))
            continue
        nested = _nested_model(model, str(key), item)
        if nested is not None:
            found += find_unknown_keys(item, nested, prefix=f"{path}.", owners=owners, tolerated=tolerated)
    return found


def _field_names(model: type[BaseModel]) -> set[str]:
    """Field names and aliases (a block with ``populate_by_name`` accepts both)."""
    return set(model.model_fields) | {info.alias for info in model.model_fields.values() if info.alias}


def _nested_model(model: type[BaseModel], key: str, item: Any) -> type[BaseModel] | None:
    """The model a known key's object value is parsed into, or None (a scalar, a list, a free-form dict).

    A discriminated union (``optimizer`` by ``kind``, ``stable_opd`` by ``mode``) picks the member whose
    tag the value names; without a tag the parser refuses the value itself, so it is not walked."""
    if not isinstance(item, dict):
        return None
    info = next((field for name, field in model.model_fields.items() if key in (name, field.alias)), None)
    if info is None:
        return None
    members = _models_in(info.annotation)
    if len(members) == 1:
        return members[0]
    tag = info.discriminator if isinstance(info.discriminator, str) else None
    if tag is None or tag not in item:
        return None
    for member in members:
        tag_field = member.model_fields.get(tag)
        if tag_field is not None and item[tag] in typing.get_args(tag_field.annotation):
            return member
    return None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through ``Optional``, ``Union`` and ``Annotated``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (list, dict, tuple, set):
        return []
    return [model for argument in typing.get_args(annotation) for model in _models_in(argument)]
