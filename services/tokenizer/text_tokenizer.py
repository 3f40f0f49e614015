"""The model's tokenizer, built from the files ``save_pretrained`` writes, with the ``tokenizers`` library only.

It behaves like transformers' fast tokenizer on the same files (encode, decode,
special tokens, add_bos/add_eos of tokenizer_config.json, the chat template) but
never imports transformers or torch, so the frontend stays a small CPU process.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable

from tokenizers import AddedToken, Tokenizer, processors

from services.tokenizer.chat_template import ChatTemplate

# Files of a tokenizer directory that matter here (what the worker's handshake carries).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
MAX_REQUEST_TEMPLATES = 16  # requests' own chat templates kept compiled (``request_template``)
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_tokenizer_dir(path: str) -> dict[str, bytes]:
    """The tokenizer files of an HF model or tokenizer directory (file name -> content)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    files = {}
    for name in TOKENIZER_FILES:
        full = os.path.join(path, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                files[name] = f.read()
    if "tokenizer.json" not in files:
        raise FileNotFoundError(f"{path!r} has no tokenizer.json (only fast tokenizers are supported)")
    return files


def _token_text(value) -> str | None:
    """A special token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _json(files: dict[str, bytes], name: str) -> dict:
    if name not in files:
        return {}
    try:
        data = json.loads(files[name].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _chat_template_source(files: dict[str, bytes], config: dict) -> str | None:
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode("utf-8")
    template = _json(files, "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class TextTokenizer:
    """Encode, decode and chat-render for one model; built from values, reads no files."""

    def __init__(
        self,
        backend: Tokenizer,
        special_tokens: dict[str, str],
        extra_special_tokens: list[str],
        chat_template: str | None,
    ):
        self._backend = backend
        self.special_tokens = special_tokens  # "bos_token" -> "<s>", only those set
        self.special_token_ids = {
            i
            for i in (backend.token_to_id(t) for t in [*special_tokens.values(), *extra_special_tokens])
            if i is not None
        }
        self.special_token_ids |= {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        variables: dict[str, object] = dict(special_tokens)
        if extra_special_tokens:
            variables["additional_special_tokens"] = list(extra_special_tokens)
        self._template_variables = variables
        self.chat_template = ChatTemplate(chat_template, variables) if chat_template else None
        self._templates: dict[str, ChatTemplate] = {}  # other templates by source (``template_for``)
        self._request_templates: dict[str, ChatTemplate] = {}  # requests' own, least recently used first
        self._request_templates_lock = threading.Lock()
        # A post-processor that adds no tokens (e.g. a template of "$A" alone) leaves the ids as they are but still
        # costs as much as the rest of a short prompt's encode: skip it then.
        self._post_adds_tokens = backend.num_special_tokens_to_add(False) > 0

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> TextTokenizer:
        """From tokenizer.json, tokenizer_config.json, special_tokens_map.json and a chat template file."""
        if "tokenizer.json" not in files:
            raise ValueError(f"no tokenizer.json among the tokenizer files ({', '.join(sorted(files)) or 'none'})")
        backend = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        config = _json(files, "tokenizer_config.json")
        special_map = _json(files, "special_tokens_map.json")

        special_tokens = {}
        for key in NAMED_SPECIAL_TOKENS:
            text = _token_text(config.get(key)) or _token_text(special_map.get(key))
            if text:
                special_tokens[key] = text
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        extra = extra or special_map.get("additional_special_tokens") or []
        extra_tokens = [t for t in (_token_text(x) for x in (extra if isinstance(extra, list) else [])) if t]

        missing = [t for t in [*special_tokens.values(), *extra_tokens] if backend.token_to_id(t) is None]
        if missing:  # transformers adds named special tokens the vocabulary lacks
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        # As in transformers 5, tokenizer.json's post-processor decides whether BOS/EOS are added (transformers
        # drops add_bos_token/add_eos_token when tokenizer.json exists). Without one, the flags build it, as
        # transformers 4's Llama fast tokenizer did.
        if backend.post_processor is None:
            _set_bos_eos(backend, special_tokens, bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))
        return cls(backend, special_tokens, extra_tokens, _chat_template_source(files, config))

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The whole tokenizer as tokenizer.json text (what structured outputs compile against)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast releases the GIL while it works (encode does not), so a long prompt tokenized in a
        # thread leaves the event loop and the other streams running; it skips only character offsets.
        add = add_special_tokens and self._post_adds_tokens
        return self._backend.encode_batch_fast([text], add_special_tokens=add)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """``decode`` with the flag bound, for per-token callers (no Python frame of its own)."""
        return functools.partial(self._backend.decode, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary entry of each id (e.g. 'Ġhello'), '' for ids outside the vocabulary."""
        return [self._backend.id_to_token(i) or "" for i in token_ids]

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (a byte of a split character decodes to U+FFFD)."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def template_for(self, source: str) -> ChatTemplate:
        """A chat template of another source (``--chat-template``, a tool template) with this tokenizer's special
        tokens as its variables, compiled once."""
        template = self._templates.get(source)
        if template is None:
            template = self._templates[source] = ChatTemplate(source, self._template_variables)
        return template

    def request_template(self, source: str) -> ChatTemplate:
        """A request's own chat template (vLLM's ``chat_template`` field), compiled in the same sandbox; the last
        ``MAX_REQUEST_TEMPLATES`` are kept compiled. Raises ValueError when it does not compile."""
        with self._request_templates_lock:  # requests are prepared on several threads
            template = self._request_templates.pop(source, None)
        if template is None:
            template = ChatTemplate(source, self._template_variables)
        with self._request_templates_lock:
            self._request_templates[source] = template
            while len(self._request_templates) > MAX_REQUEST_TEMPLATES:
                self._request_templates.pop(next(iter(self._request_templates)))
        return template

    def use_chat_template(self, source: str) -> None:
        """Render chats with ``source`` instead of the model's own template (``--chat-template``)."""
        self.chat_template = self.template_for(source)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template: ChatTemplate | None = None,
        extra: dict | None = None,
    ) -> str:
        template = template or self.chat_template
        if template is None:
            raise ValueError("the model's tokenizer has no chat template")
        return template.render(messages, add_generation_prompt, tools, extra)

    def encode_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        template: ChatTemplate | None = None,
        extra: dict | None = None,
    ) -> list[int]:
        """Rendered with the generation prompt (by ``template``, default the model's, with ``extra`` variables);
        the template writes its own special tokens (BOS included)."""
        return self.encode(self.render_chat(messages, True, tools, template, extra), add_special_tokens=False)


def _set_bos_eos(backend: Tokenizer, special_tokens: dict[str, str], add_bos: bool, add_eos: bool) -> None:
    bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
    add_bos = add_bos and bos is not None and backend.token_to_id(bos) is not None
    add_eos = add_eos and eos is not None and backend.token_to_id(eos) is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = []
    if add_bos:
        special.append((bos, backend.token_to_id(bos)))
    if add_eos and eos != bos:
        special.append((eos, backend.token_to_id(eos)))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
