"""What the reference stands on: corpus ingestion, the tokenizer, bytes on disk, the run directory, the CLI,
the kernel's launch table."""
