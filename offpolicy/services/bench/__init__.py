"""`offpolicy bench`'s parts: records, the targets table, docs/benchmarks.md rendered, the GPU run."""
