"""Layers shared by the model families in ``models/``: linear and embedding, norm, rotary embeddings."""
