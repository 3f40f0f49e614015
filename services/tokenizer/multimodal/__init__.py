"""Images in the frontend: where an image may come from, decoding it within limits, processing it the way the
model's image processor does, and the placeholder tokens that stand for it in the prompt."""
