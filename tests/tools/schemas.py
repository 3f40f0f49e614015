"""Twenty function tools with varied parameter schemas: nested objects, arrays, enums, required fields."""

from __future__ import annotations


def tool(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required or list(properties),
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


S = {"type": "string", "maxLength": 12}
TOOLS = [
    tool("get_weather", "Current weather in a city", {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    tool("add", "Add two integers", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
    tool(
        "search", "Search the web", {"query": S, "limit": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]
    ),
    tool(
        "send_email",
        "Send an email",
        {
            "to": {"type": "array", "items": S, "minItems": 1, "maxItems": 2},
            "subject": S,
            "urgent": {"type": "boolean"},
        },
    ),
    tool(
        "book_flight",
        "Book a flight",
        {
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "passengers": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                    "required": ["name", "age"],
                    "additionalProperties": False,
                },
            },
        },
    ),
    tool(
        "set_alarm",
        "Set an alarm",
        {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "minute": {"type": "integer", "minimum": 0, "maximum": 59},
        },
    ),
    tool(
        "convert",
        "Convert units",
        {"value": {"type": "number"}, "from_unit": {"enum": ["m", "ft", "km"]}, "to_unit": {"enum": ["m", "ft", "km"]}},
    ),
    tool(
        "create_event",
        "Create a calendar event",
        {
            "title": S,
            "when": {
                "type": "object",
                "properties": {
                    "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
                    "all_day": {"type": "boolean"},
                },
                "required": ["date", "all_day"],
                "additionalProperties": False,
            },
        },
    ),
    tool("no_args", "Takes nothing", {}),
    tool("rate", "Rate a movie", {"movie": S, "stars": {"enum": [1, 2, 3, 4, 5]}}),
    tool("translate", "Translate text", {"text": S, "target": {"enum": ["fr", "de", "es", "ja"]}}),
    tool(
        "order_pizza",
        "Order pizza",
        {
            "size": {"enum": ["small", "large"]},
            "toppings": {
                "type": "array",
                "items": {"enum": ["ham", "olive", "basil"]},
                "maxItems": 3,
            },
        },
        ["size"],
    ),
    tool(
        "move",
        "Move a robot",
        {
            "position": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "speed": {"type": "string", "enum": ["slow", "fast"]},
        },
    ),
    tool(
        "lookup_user",
        "Find a user",
        {
            "id": {"type": "integer", "minimum": 1},
            "fields": {"type": "array", "items": {"enum": ["name", "email", "age"]}, "maxItems": 3},
        },
        ["id"],
    ),
    tool("nullable", "Maybe a note", {"note": {"anyOf": [S, {"type": "null"}]}}),
    tool(
        "matrix",
        "A small matrix",
        {
            "rows": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "maxItems": 2, "items": {"type": "integer"}},
            }
        },
    ),
    tool("set_color", "Set a hex color", {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    tool(
        "tag",
        "Tag an item",
        {"item": S, "tags": {"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 2}},
    ),
    tool(
        "deep",
        "Deeply nested",
        {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {
                            "c": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}
                        },
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
    ),
    tool(
        "ping",
        "Ping a host",
        {"host": S, "count": {"type": "integer", "minimum": 1, "maximum": 5}, "ipv6": {"type": "boolean"}},
        ["host"],
    ),
]
