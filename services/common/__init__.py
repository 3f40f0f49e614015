"""Code shared by the three services: configuration, errors, gRPC server plumbing."""
