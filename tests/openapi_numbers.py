"""Calls that put one number (non-finite, extreme) into one numeric field of an OpenAPI operation, for the
coordinator's and the engine's fuzz tests."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass

NON_FINITE = (math.nan, math.inf, -math.inf)
NON_FINITE_TEXT = ("nan", "NaN", "inf", "-inf", "Infinity", "-Infinity")  # as a query or path parameter
# past int64, uint64 and float64's range or at their edge: what Redis, torch and struct packing choke on
EXTREME = ((1 << 63) - 1, -(1 << 63), 1 << 63, 1 << 64, -(1 << 64), 10**30, 1e308, -1e308, 5e-324)
EXTREME_TEXT = (str((1 << 63) - 1), str(1 << 63), str(1 << 64), str(-(1 << 64)), "1e308", "-1e308", "1" + "0" * 400)


@dataclass
class NumberCase:
    method: str
    path: str  # its parameters filled in
    field: tuple  # where the value is: a body path, or ("query" | "path", name)
    value: float | int | str
    body: object = None
    query: dict | None = None

    @property
    def content(self) -> bytes | None:
        return None if self.body is None else json.dumps(self.body).encode()  # NaN, Infinity, -Infinity


def number_cases(
    spec: dict, path_values: dict[str, str], values: tuple, texts: tuple, bases: dict[str, dict] | None = None
) -> list[NumberCase]:
    """For every operation of an OpenAPI document: its JSON body (every property present, one item in every
    list and map, merged with `bases[path]`: None drops a key) with each numeric field in turn set to each of
    `values`; and each numeric query or path parameter set to each of `texts`. Other path parameters come
    from `path_values` ("a" if absent)."""
    cases = []
    for template, operations in spec["paths"].items():
        for method, op in operations.items():
            params = op.get("parameters", [])
            fill = {p["name"]: path_values.get(p["name"], "a") for p in params if p["in"] == "path"}
            body_schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body_schema is not None:
                body = _merge(_sample(spec, body_schema), (bases or {}).get(template, {}))
                cases += [
                    NumberCase(method.upper(), template.format(**fill), field, value, body=_set(body, field, value))
                    for field in _numeric_paths(body)
                    for value in values
                ]
            for p in params:
                if not _numeric(spec, p["schema"]) or p["in"] not in ("query", "path"):
                    continue
                for text in texts:
                    where = p["in"]
                    path = template.format(**{**fill, p["name"]: text} if where == "path" else fill)
                    cases.append(
                        NumberCase(
                            method.upper(),
                            path,
                            (where, p["name"]),
                            text,
                            query={p["name"]: text} if where == "query" else None,
                        )
                    )
    return cases


def _merge(body: dict, base: dict) -> dict:
    for key, value in base.items():
        if value is None:
            body.pop(key, None)
        elif isinstance(value, dict) and isinstance(body.get(key), dict):
            _merge(body[key], value)
        else:
            body[key] = value
    return body


def _resolve(spec: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _numeric(spec: dict, schema: dict) -> bool:
    schema = _resolve(spec, schema)
    options = schema.get("anyOf") or schema.get("oneOf") or [schema]
    return any(_resolve(spec, o).get("type") in ("number", "integer") for o in options)


def _sample(spec: dict, schema: dict, depth: int = 0):
    """A value of `schema` within its bounds where it states them. A schema that allows anything gets a
    number, so a field typed Any is tried with NaN too."""
    schema = _resolve(spec, schema)
    if depth > 12:
        return None
    options = [o for o in schema.get("anyOf") or schema.get("oneOf") or [] if _resolve(spec, o).get("type") != "null"]
    if options or "allOf" in schema:
        return _sample(spec, (options or schema["allOf"])[0], depth + 1)
    if "const" in schema or "enum" in schema:
        return schema.get("const", (schema.get("enum") or [None])[0])
    kind, default = schema.get("type"), schema.get("default")
    if kind == "null":  # a field that takes only null (a feature not served): left out
        return None
    if kind == "object":
        body = {k: _sample(spec, v, depth + 1) for k, v in schema.get("properties", {}).items()}
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and not body:
            key = (_resolve(spec, schema.get("propertyNames", {})).get("enum") or ["a"])[0]
            body[key] = _sample(spec, extra, depth + 1)
        return {k: v for k, v in body.items() if v is not None}
    if kind == "array":
        return [_sample(spec, schema.get("items", {}), depth + 1)]
    if kind in ("integer", "number", None):
        value = (
            default
            if isinstance(default, (int, float))
            else schema.get("minimum", schema.get("exclusiveMinimum", 0) + 1 if "exclusiveMinimum" in schema else 1)
        )
        value = min(value, schema.get("maximum", value))
        return int(value) if kind == "integer" else value
    if kind == "boolean":
        return False
    return default if isinstance(default, str) else "a"


def _numeric_paths(value, at: tuple = ()) -> list[tuple]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _numeric_paths(v, (*at, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _numeric_paths(v, (*at, i))]
    return [at] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _set(body, field: tuple, value):
    body = copy.deepcopy(body)
    inner = body
    for key in field[:-1]:
        inner = inner[key]
    inner[field[-1]] = value
    return body


def names_field(locations: list[list], field: tuple) -> bool:
    """Whether one of the error locations (body path, union branches included) passes through `field`."""
    wanted = [str(k) for k in field]
    for loc in locations:
        it = iter(str(k) for k in loc)
        if all(any(part == w for part in it) for w in wanted):
            return True
    return False
