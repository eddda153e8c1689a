"""Model architectures (MPT) and the layers they are built from."""
