"""Validation rules, one module per group: `paged` (PagedAttention structure, with `paged_dims`,
`paged_quant`, `paged_values`), `gqa` (GroupQueryAttention), and the helpers both share
(`common`, `common_features`). Each module exports `RULES` and `RULE_DOCS` / `DOCS`."""
