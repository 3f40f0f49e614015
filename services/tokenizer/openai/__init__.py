"""The OpenAI-compatible HTTP API of the frontend (FastAPI on uvicorn), with /health and /metrics."""
