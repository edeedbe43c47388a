"""pagedkit.runtime"""
