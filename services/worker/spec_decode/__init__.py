"""Speculative decoding on the worker: proposers, verification of proposals, and the policy that turns it down."""
