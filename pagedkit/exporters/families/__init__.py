"""One module per model family; `pagedkit.exporters.registry` maps Hugging Face model types to them."""
