"""GroupQueryAttention rules (placeholder: being written)."""
RULES: list = []
