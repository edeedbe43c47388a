"""pagedkit.rewriters: planned, not implemented yet (open issue): GQA <-> PagedAttention graph passes and a
decomposition of PagedAttention into standard ONNX ops. Nothing here runs yet."""
