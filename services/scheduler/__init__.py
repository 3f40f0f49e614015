"""The scheduler service: requests, KV blocks, prefix cache and the step loop that drives a worker.

Pure Python over plain data; nothing here imports torch.
"""
