"""support"""
