"""Tool calling: the tools a request offers, the grammar that holds the model to them, the parsers that turn the
model's text into calls, and the streamed deltas of those calls."""
