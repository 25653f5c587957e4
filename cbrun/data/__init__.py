"""Datasets in, results out: readers, row validation, output formats, writers, resume, the job loop."""
