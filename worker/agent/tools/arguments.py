"""A tool call's arguments against the tool's own schema, and the size of its result.

The arguments are the model's, and a model can be prompt-injected: a tool's schema is a
contract only where it is checked. The checks cover what the tools' schemas use (``type``
of each property, ``enum``, ``minimum`` / ``maximum``, ``minLength`` / ``maxLength``,
``required``); a call that breaks one is answered with an error the model can read, and
the tool is not run. What models send and JSON Schema allows is taken as meant: ``null``
for an argument that is not required is its absence (OpenAI's strict mode sends every
property), a whole number written ``3600.0`` is an integer, and a property the schema does
not name is left out (the schemas do not forbid them).

A result is cut to ``RESULT_MAX_CHARS`` (nanobot's ``max_tool_result_chars``): it becomes a
row of the session, sent back to the model on every later turn and written as one script
argument, which a deployment caps (``proto-max-bulk-len``).
"""

from __future__ import annotations

from typing import Any

RESULT_MAX_CHARS = 16_000
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def checked_arguments(
    schema: dict[str, Any], arguments: dict[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """``arguments`` as the tool takes them (see the module's text), and why they break
    ``schema`` (one reason), or None when they do not."""
    properties: dict[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", ()))
    args: dict[str, Any] = {}
    for name, value in arguments.items():
        spec = properties.get(name)
        if spec is None or (value is None and name not in required):
            continue
        if spec.get("type") == "integer" and isinstance(value, float) and value.is_integer():
            value = int(value)
        why = _value_error(spec, value)
        if why:
            return args, f"{name!r} {why}"
        args[name] = value
    for name in sorted(required):
        if name not in args:
            return args, f"{name!r} is required"
    return args, None


def _value_error(spec: dict[str, Any], value: Any) -> str | None:
    kind = spec.get("type")
    if kind in _TYPES:
        is_bool = isinstance(value, bool)
        if not isinstance(value, _TYPES[kind]) or (is_bool and kind != "boolean"):
            return f"must be of type {kind}"
    if "enum" in spec and value not in spec["enum"]:
        return f"must be one of {', '.join(map(str, spec['enum']))}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in spec and value < spec["minimum"]:
            return f"must be at least {spec['minimum']}"
        if "maximum" in spec and value > spec["maximum"]:
            return f"must be at most {spec['maximum']}"
    if isinstance(value, str):
        if "minLength" in spec and len(value) < spec["minLength"]:
            return f"must have at least {spec['minLength']} characters"
        if "maxLength" in spec and len(value) > spec["maxLength"]:
            return f"must have at most {spec['maxLength']} characters"
    return None


def bounded_result(result: str, limit: int = RESULT_MAX_CHARS) -> str:
    """``result``, cut to ``limit`` characters (its beginning kept) with a note saying so."""
    if len(result) <= limit:
        return result
    keep = max(0, limit - 64)  # room for the note
    return result[:keep] + f"\n... (cut: {len(result) - keep} more characters)"
