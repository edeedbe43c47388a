"""paged-run: greedy generation over a model folder with pagedkit's runtime, and parity with Hugging Face
(cli.py; see docs/runtime.md)."""
