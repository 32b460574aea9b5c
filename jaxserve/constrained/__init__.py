"""constrained"""
