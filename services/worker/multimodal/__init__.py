"""Images on the worker: the inputs a request carries and the cache of their encoder outputs."""
