"""The data contracts and their I/O: prompt datasets and column mapping, the rollout and scored
Parquet tables, the padded batch, prompt encoding, atomic writes and run-folder paths."""
