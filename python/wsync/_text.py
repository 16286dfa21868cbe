"""Manifest metadata and transport options are text on the wire; how Python values become it."""

import json
from typing import Any, Dict, Mapping, Optional

from wsync._errors import InvalidArgumentError


def encode_metadata(metadata: Optional[Mapping[str, Any]]) -> Dict[str, str]:
    """Manifest metadata: str values go as they are, others as JSON text."""
    if metadata is None:
        return {}
    out = {}
    for k, v in dict(metadata).items():
        if not isinstance(k, str):
            raise TypeError(f"metadata keys must be str, got {k!r}")
        out[k] = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return out


def options_text(options: Optional[Mapping[str, Any]], where: str = "options") -> Dict[str, str]:
    """Transport options as text, as ``--transport-option`` gives them: numbers and booleans
    become their JSON text; anything else is refused, naming the option."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InvalidArgumentError(f"{where}: must be a dict of option names to values, "
                                   f"e.g. {{\"dir\": \"/shared/w\"}}")
    out = {}
    for k, v in options.items():
        if isinstance(v, str):
            out[str(k)] = v
        elif isinstance(v, (bool, int, float)):
            out[str(k)] = json.dumps(v)
        else:
            raise InvalidArgumentError(f"{where}.{k}: must be a string or a number")
    return out
