"""review.commands"""
