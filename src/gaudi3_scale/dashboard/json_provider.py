"""Flask's JSON, written through `config.strict_json`: every API response, error body and `tojson` in a template
parses with the page's `JSON.parse`, a diverged run's NaN loss included (spelled "NaN", drawn as a gap with a
marker by static/charts.js). Imported by `app.create_app` only, so the package imports without Flask."""

from __future__ import annotations

from typing import Any

from flask.json.provider import DefaultJSONProvider

from gaudi3_scale.config import strict_json

__all__ = ["StrictJSONProvider"]


class StrictJSONProvider(DefaultJSONProvider):
    sort_keys = False  # keys in the order the views build them

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        """`DefaultJSONProvider.dumps` (its defaults; `response` passes the separators) with strict_json's encoder."""
        kwargs.setdefault("default", self.default)
        kwargs.setdefault("ensure_ascii", self.ensure_ascii)
        kwargs.setdefault("sort_keys", self.sort_keys)
        return strict_json.dumps(obj, **kwargs)
