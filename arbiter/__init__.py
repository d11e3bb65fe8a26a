"""hvarbiter: the VM/container I/O arbiter (docs/arbiter.md)."""
