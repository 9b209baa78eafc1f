"""merge"""
