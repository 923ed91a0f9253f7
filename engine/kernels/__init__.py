"""Compute kernels of our own, in C, compiled on the machine at first use (build.py): where
torch's kernels leave speed on the table for batch-1 decoding, and where the engine needs a
property torch does not promise (bf16.py: every row computed alike)."""
