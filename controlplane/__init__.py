"""snoozeml control plane: renders model repositories, drives Triton, wakes and evicts models."""
