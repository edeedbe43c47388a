"""pagedkit.kernels"""
