"""Test support shipped with the package: launching real SGLang servers on this machine."""
