"""Model code, one module per architecture family."""
