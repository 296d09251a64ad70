"""Fail-slow detection and mitigation (Falcon sections 4-5): pure algorithms, no I/O."""
