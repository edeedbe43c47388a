"""PagedAttention rules (placeholder: being written)."""
RULES: list = []
