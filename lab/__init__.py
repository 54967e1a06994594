"""reamer's host lab: production-like hosts in QEMU VMs (software emulation) running tests/hosts/ inside."""
