"""Runtime: memory accounting and the builtins the VM calls."""
