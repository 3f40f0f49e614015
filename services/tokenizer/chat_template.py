"""Chat templates rendered with jinja2 the way transformers' ``apply_chat_template`` renders them.

Templates come from model repositories, so they are untrusted code: they run in an
immutable sandbox. The environment matches transformers' (trim_blocks, lstrip_blocks,
loop controls, ``raise_exception``, a ``tojson`` that does not escape HTML,
``strftime_now``) so that a template renders to the same text here, without
importing transformers.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidArgument

RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})  # what render itself passes


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) and render the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the variables every render sees (bos_token, eos_token, ...)."""

    def __init__(self, source: str, variables: dict[str, object]):
        env = _environment()
        try:
            self._template = env.from_string(source)
            names = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e}") from e
        self.source = source
        self._variables = dict(variables)
        # Whether the template writes tools and tool calls itself (transformers passes ``tools`` to every template).
        self.uses_tools = "tools" in names

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        extra: dict | None = None,
    ) -> str:
        """The conversation (and the tools offered, in OpenAI's shape) as prompt text; ``extra``: more variables
        (a request's ``chat_template_kwargs``, e.g. ``enable_thinking``), which may replace the special-token
        variables but not the conversation's (``RESERVED``). A template that rejects it raises InvalidArgument
        on messages."""
        try:
            return self._template.render(
                **self._variables,
                **(extra or {}),
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError) as e:
            # TypeError and the like: a template that meets a value of a shape it does not expect (e.g. no content).
            raise InvalidArgument("messages", f"the chat template rejected the conversation: {e}") from e
