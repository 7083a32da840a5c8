"""`offpolicy bench`'s parts: benchmark records, the targets table, docs/benchmarks.md rendered, the GPU run."""
