"""Model-card templates (package data), filled when a model is exported.

One template per family (``<family>.md``: front matter and the family's exact
semantics) and the shared ``_usage.md`` (loading, generation, fine-tuning and the
configuration table) that each includes as ``{{usage}}``. Placeholders are
``{{name}}``; filling a card with a placeholder left unset is an error.
"""

from __future__ import annotations

import re
from importlib import resources

__all__ = ["CARD_TEMPLATES", "render_card"]

# model_type -> template file
CARD_TEMPLATES = {
    "mnemo_mom": "mom.md",
    "mnemo_mc_titans": "mc_titans.md",
    "mnemo_atlas": "atlas.md",
    "mnemo_deep_transformer": "deep_transformer.md",
}

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def _template(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def _fill(text: str, fields: dict[str, str]) -> str:
    missing = sorted({m for m in _PLACEHOLDER.findall(text) if m not in fields})
    if missing:
        raise KeyError(f"model card placeholders without a value: {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: fields[m.group(1)], text)


def render_card(model_type: str, fields: dict[str, str]) -> str:
    """The filled model card of a ``model_type``, from its template and the shared usage section."""
    if model_type not in CARD_TEMPLATES:
        raise KeyError(f"no model card template for model_type {model_type!r}")
    usage = _fill(_template("_usage.md"), fields)
    return _fill(_template(CARD_TEMPLATES[model_type]), {**fields, "usage": usage})
