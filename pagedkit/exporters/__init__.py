"""pagedkit.exporters"""
