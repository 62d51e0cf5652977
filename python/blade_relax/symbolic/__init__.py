"""Symbolic shapes: dims, byte expressions over them, and the global shape graph of a function."""
