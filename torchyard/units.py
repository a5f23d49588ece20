"""How sizes read in what people see: one spelling for the api's messages and the CLI's tables."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """812 B, 3.4 KiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
