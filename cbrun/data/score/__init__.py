"""`cbrun score`'s rows: preparer.py (what a row asks), format.py (what it becomes), row_kind.py (the
engine requests it makes), parts.py (the three, as the command line chose them)."""
