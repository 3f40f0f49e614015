"""OpenAI's Responses API (``/v1/responses``) as a translation onto the chat-completions path: a request becomes the
chat body the front door prepares, and the chat result or stream becomes Responses output items or typed events."""
