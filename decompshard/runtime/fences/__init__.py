"""fences"""
