"""pagedkit.rewriters"""
