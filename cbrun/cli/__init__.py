"""The command line: `cbrun generate` and `cbrun bench` (thin: parse, wire, report)."""
