"""`python -m tinyvllm bench`: workloads, the runs, the HF comparison, the report."""
